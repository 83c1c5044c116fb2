//! `docs/HOW_IT_WORKS.md` tells the next engineer where things live: every path it names
//! exists, and its layout names every folder and every file at the top of
//! `batch-size-runtime/src`, so that the map cannot drift from the tree unnoticed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn doc() -> String {
    std::fs::read_to_string(repository().join("docs/HOW_IT_WORKS.md")).unwrap()
}

/// The layout of `src`: the Layout section up to its paragraph on the other crates.
fn src_layout(doc: &str) -> &str {
    let layout = section(doc, "Layout");
    &layout[..layout.find("The other crates").unwrap_or(layout.len())]
}

/// The text between `## {heading}` and the next `## `.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("no section {heading}"));
    let rest = &doc[start + heading.len() + 5..];
    &rest[..rest.find("\n## ").unwrap_or(rest.len())]
}

/// Every `code span` in `text` that reads as a path: a file with an extension of source or
/// configuration, or a folder ending in `/`; placeholders (`<framework>`) and globs left out.
fn paths(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|span| !span.contains(['<', '*', ' ', '(', ':']))
        .filter(|span| {
            span.ends_with('/')
                || [".rs", ".toml", ".md", ".sh"]
                    .iter()
                    .any(|extension| span.ends_with(extension))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_path_the_layout_names_exists_under_src() {
    let doc = doc();
    let src = repository().join("batch-size-runtime/src");
    let named = paths(src_layout(&doc));
    let missing: Vec<&String> = named
        .iter()
        .filter(|path| !path.contains('-') && !src.join(path).exists())
        .collect();
    assert!(
        missing.is_empty(),
        "named in the layout, not in src: {missing:?}"
    );
}

#[test]
fn the_layout_names_every_folder_and_top_level_file_of_src() {
    let doc = doc();
    let named = paths(src_layout(&doc));
    let src = repository().join("batch-size-runtime/src");
    let mut unnamed = Vec::new();
    let mut folders = vec![src.clone()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            let relative = path
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if path.is_dir() {
                if !named.contains(&format!("{relative}/")) {
                    unnamed.push(format!("{relative}/"));
                }
                folders.push(path);
            } else if folder == src && !named.contains(&relative) {
                unnamed.push(relative);
            }
        }
    }
    unnamed.sort();
    assert!(unnamed.is_empty(), "in src, not in the layout: {unnamed:?}");
}

#[test]
fn every_repository_path_the_doc_names_exists() {
    let doc = doc();
    let root = repository();
    let missing: Vec<String> = paths(&doc)
        .into_iter()
        // A path from the repository's root: a folder in it, then more.
        .filter(|path| path.trim_end_matches('/').contains('/'))
        .filter(|path| {
            root.join(path.split('/').next().unwrap_or_default())
                .is_dir()
        })
        .filter(|path| !root.join(path).exists())
        .collect();
    assert!(
        missing.is_empty(),
        "named in HOW_IT_WORKS.md, not in the repository: {missing:?}"
    );
}
