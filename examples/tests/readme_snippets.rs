//! The README's Rust blocks paste: each one is a whole program, with no hidden lines, using only
//! the crates the README's Install section lists, at the versions this crate builds them with.
//!
//! The blocks themselves are compiled and run as doctests of this crate (`src/lib.rs` includes
//! the README), and rustdoc compiles a block that has its own `fn main` as it is written. This
//! test checks what makes that the same program as one pasted into a fresh crate's `main.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests assert by unwrapping

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

/// A fenced block: its info string (what follows the opening fence), its first line's number
/// and its text.
#[derive(Debug)]
struct Block {
    info: String,
    line: usize,
    code: String,
}

fn read(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    fs::read_to_string(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// Every fenced block of a Markdown text, in order.
fn fenced_blocks(markdown: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<Block> = None;
    for (index, line) in markdown.lines().enumerate() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => {
                open = Some(Block {
                    info: info.trim().to_owned(),
                    line: index + 2,
                    code: String::new(),
                })
            }
            (Some(_), Some("")) => blocks.extend(open.take()),
            (Some(block), _) => {
                block.code.push_str(line);
                block.code.push('\n');
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "a fence is never closed");
    blocks
}

/// The crates a Rust block names: the first segment of each path (`anyhow::Result`,
/// `use candle_core::{...}`), less the standard library's and the block's own lowercase names
/// that are never paths' roots.
fn crates_named(code: &str) -> Vec<String> {
    let mut crates = Vec::new();
    let bytes = code.as_bytes();
    for (at, _) in code.match_indices("::") {
        let start = code[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let name = &code[start..at];
        // `a::b::c` counts once (at `a`); `x.to_scalar::<f32>()` and `Tensor::randn` are not crates.
        let before = code[..start].trim_end();
        let continues_a_path = before.ends_with("::") || before.ends_with('.');
        let is_crate_like = name.chars().next().is_some_and(|c| c.is_ascii_lowercase());
        let is_turbofish = bytes.get(at + 2) == Some(&b'<');
        if name.is_empty() || continues_a_path || !is_crate_like || is_turbofish {
            continue;
        }
        if ["std", "core", "alloc", "crate", "self", "super"].contains(&name) {
            continue;
        }
        if !crates.iter().any(|known| known == name) {
            crates.push(name.to_owned());
        }
    }
    crates
}

/// `name = "version"`, `name = { version = "version", ... }` or `name = { path = ... }` lines of
/// a `[dependencies]` table, by crate name (dashes as written); `None` for a path or a
/// workspace dependency.
fn dependencies(toml: &str) -> BTreeMap<String, Option<String>> {
    let mut table = BTreeMap::new();
    let mut in_dependencies = false;
    for line in toml.lines() {
        let line = line.split(" #").next().unwrap_or_default().trim();
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
            continue;
        }
        if !in_dependencies || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = line.split_once('=') else {
            continue;
        };
        let name = name.trim().trim_end_matches(".workspace").to_owned();
        let value = value.trim();
        let version = if let Some(quoted) = value.strip_prefix('"') {
            quoted.split('"').next().map(str::to_owned)
        } else {
            value
                .split_once("version = \"")
                .and_then(|(_, rest)| rest.split('"').next())
                .map(str::to_owned)
        };
        table.insert(name, version);
    }
    table
}

#[test]
fn readme_snippets_paste_as_written() {
    let readme = read("../README.md");
    let blocks = fenced_blocks(&readme);
    let rust: Vec<&Block> = blocks
        .iter()
        .filter(|block| block.info.starts_with("rust"))
        .collect();
    assert!(!rust.is_empty(), "the README has no Rust block");

    // The Install section's [dependencies] block: what a user pastes beside the snippets.
    let install = &readme[readme.find("## Install").expect("an Install section")..];
    let listed = fenced_blocks(install)
        .into_iter()
        .find(|block| block.info == "toml" && block.code.contains("[dependencies]"))
        .map(|block| dependencies(&block.code))
        .expect("a [dependencies] block in the Install section");

    // The versions this crate compiles the README's doctests with.
    let ours = dependencies(&read("Cargo.toml"));
    let workspace = read("../Cargo.toml");
    let workspace = workspace.replace("[workspace.dependencies]", "[dependencies]");
    let workspace = dependencies(&workspace);

    for block in rust {
        let at = format!("README.md, the Rust block at line {}", block.line);
        assert_eq!(
            block.info, "rust",
            "{at}: `ignore`, `no_run` and the like would skip it"
        );
        for line in block.code.lines() {
            let hidden = line.trim_start() == "#" || line.trim_start().starts_with("# ");
            assert!(
                !hidden,
                "{at}: a line rustdoc hides, shown in Markdown: {line:?}"
            );
        }
        assert!(
            block.code.contains("fn main()"),
            "{at}: no `fn main`; rustdoc would wrap it in one, a pasted copy would not compile"
        );
        for name in crates_named(&block.code) {
            let dashed = name.replace('_', "-");
            let version = listed
                .get(&dashed)
                .unwrap_or_else(|| panic!("{at}: uses `{name}`, not in the Install section"));
            let Some(version) = version else { continue }; // the path dependency: this checkout
            let built_with = match ours.get(&dashed) {
                Some(Some(version)) => version,
                Some(None) => workspace[&dashed].as_ref().expect("a workspace version"),
                None => panic!("{at}: `{dashed}` is not a dependency of batch-size-examples"),
            };
            assert_eq!(
                version, built_with,
                "{at}: the README lists {dashed} {version}, the doctests build {built_with}"
            );
        }
    }
}

#[test]
fn crates_named_finds_path_roots_only() {
    let code = "use candle_core::{Device, Tensor};\n\
                fn main() -> anyhow::Result<()> {\n\
                    let x = Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?;\n\
                    let y = x.to_scalar::<f32>()?; let z = std::mem::size_of::<u8>();\n\
                    tracing_subscriber::fmt::init();\n\
                }";
    assert_eq!(
        crates_named(code),
        ["candle_core", "anyhow", "tracing_subscriber"]
    );
}
