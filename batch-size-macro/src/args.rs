//! Parsing the attribute's arguments: `starting = EXPR, min = EXPR,
//! factor = FLOAT | reduce = EXPR | policy = EXPR, max_attempts = EXPR, release = EXPR,
//! when = EXPR, notify = EXPR, on_report = EXPR, agree = EXPR, remedies = EXPR, crate = PATH`.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, ExprLit, ExprUnary, Lit, LitStr, Path, Token, UnOp};

const VALID_KEYS: &str = "`starting`, `effective`, `min`, `factor`, `reduce`, `policy`, `margin`, `max_attempts`, `cache`, `cache_dir`, `release`, `when`, `notify`, `on_report`, `agree`, `remedies`, `crate`";

/// The arguments, each with the span of its key for later errors.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) starting: Option<Expr>,
    pub(crate) min: Option<Expr>,
    pub(crate) factor: Option<Expr>,
    pub(crate) reduce: Option<Expr>,
    pub(crate) max_attempts: Option<Expr>,
    pub(crate) release: Option<Expr>,
    pub(crate) policy: Option<Expr>,
    pub(crate) margin: Option<Expr>,
    pub(crate) effective: Option<Expr>,
    pub(crate) cache: Option<Expr>,
    pub(crate) cache_dir: Option<Expr>,
    pub(crate) when: Option<Expr>,
    pub(crate) notify: Option<Expr>,
    pub(crate) on_report: Option<Expr>,
    pub(crate) agree: Option<Expr>,
    pub(crate) remedies: Option<Expr>,
    pub(crate) krate: Option<Path>,
}

mod kw {
    syn::custom_keyword!(starting);
    syn::custom_keyword!(min);
    syn::custom_keyword!(factor);
    syn::custom_keyword!(reduce);
    syn::custom_keyword!(max_attempts);
    syn::custom_keyword!(release);
    syn::custom_keyword!(policy);
    syn::custom_keyword!(margin);
    syn::custom_keyword!(effective);
    syn::custom_keyword!(cache);
    syn::custom_keyword!(cache_dir);
    syn::custom_keyword!(when);
    syn::custom_keyword!(notify);
    syn::custom_keyword!(on_report);
    syn::custom_keyword!(agree);
    syn::custom_keyword!(remedies);
}

fn set<T>(slot: &mut Option<T>, value: T, key: &str, span: Span) -> syn::Result<()> {
    if slot.is_some() {
        return Err(syn::Error::new(
            span,
            format!("duplicate argument `{key}`: give it once"),
        ));
    }
    *slot = Some(value);
    Ok(())
}

fn value<T: Parse>(input: ParseStream<'_>, key: &str, key_span: Span) -> syn::Result<T> {
    expect_eq(
        input,
        key_span,
        &format!("expected `=` after `{key}`: write `{key} = ...`"),
    )?;
    input.parse()
}

/// The `=` after a key; without it, the error is under what follows, or under the key when
/// nothing does (not under the whole attribute).
fn expect_eq(input: ParseStream<'_>, key_span: Span, message: &str) -> syn::Result<()> {
    let eq: Option<Token![=]> = input.parse()?;
    match eq {
        Some(_) => Ok(()),
        None if input.is_empty() || input.peek(Token![,]) => {
            Err(syn::Error::new(key_span, message))
        }
        None => Err(input.error(message)),
    }
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut factor_or_reduce: Option<&'static str> = None;
        let mut margin_span: Option<Span> = None;
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            let key_span = input.span();
            if lookahead.peek(kw::starting) {
                input.parse::<kw::starting>()?;
                let expr = value(input, "starting", key_span)?;
                reject_zero_or_negative(&expr, "starting")?;
                set(&mut args.starting, expr, "starting", key_span)?;
            } else if lookahead.peek(kw::min) {
                input.parse::<kw::min>()?;
                let expr = value(input, "min", key_span)?;
                reject_zero_or_negative(&expr, "min")?;
                set(&mut args.min, expr, "min", key_span)?;
            } else if lookahead.peek(kw::factor) {
                input.parse::<kw::factor>()?;
                let expr: Expr = value(input, "factor", key_span)?;
                check_factor(&expr)?;
                if args.factor.is_none() {
                    if let Some(other) = factor_or_reduce {
                        return Err(two_size_choices(key_span, other, "factor"));
                    }
                }
                set(&mut args.factor, expr, "factor", key_span)?;
                factor_or_reduce = Some("factor");
            } else if lookahead.peek(kw::reduce) {
                input.parse::<kw::reduce>()?;
                let expr = value(input, "reduce", key_span)?;
                if args.reduce.is_none() {
                    if let Some(other) = factor_or_reduce {
                        return Err(two_size_choices(key_span, other, "reduce"));
                    }
                }
                set(&mut args.reduce, expr, "reduce", key_span)?;
                factor_or_reduce = Some("reduce");
            } else if lookahead.peek(kw::policy) {
                input.parse::<kw::policy>()?;
                let expr = value(input, "policy", key_span)?;
                if args.policy.is_none() {
                    if let Some(other) = factor_or_reduce {
                        return Err(two_size_choices(key_span, other, "policy"));
                    }
                }
                set(&mut args.policy, expr, "policy", key_span)?;
                factor_or_reduce = Some("policy");
            } else if lookahead.peek(kw::margin) {
                input.parse::<kw::margin>()?;
                let expr: Expr = value(input, "margin", key_span)?;
                check_margin(&expr)?;
                set(&mut args.margin, expr, "margin", key_span)?;
                margin_span = Some(key_span);
            } else if lookahead.peek(kw::remedies) {
                input.parse::<kw::remedies>()?;
                let expr = value(input, "remedies", key_span)?;
                set(&mut args.remedies, expr, "remedies", key_span)?;
            } else if lookahead.peek(kw::effective) {
                input.parse::<kw::effective>()?;
                let expr = value(input, "effective", key_span)?;
                reject_zero_or_negative(&expr, "effective")?;
                set(&mut args.effective, expr, "effective", key_span)?;
            } else if lookahead.peek(kw::cache_dir) {
                input.parse::<kw::cache_dir>()?;
                let expr = value(input, "cache_dir", key_span)?;
                set(&mut args.cache_dir, expr, "cache_dir", key_span)?;
            } else if lookahead.peek(kw::cache) {
                input.parse::<kw::cache>()?;
                let expr = value(input, "cache", key_span)?;
                set(&mut args.cache, expr, "cache", key_span)?;
            } else if lookahead.peek(kw::when) {
                input.parse::<kw::when>()?;
                let expr = value(input, "when", key_span)?;
                set(&mut args.when, expr, "when", key_span)?;
            } else if lookahead.peek(kw::notify) {
                input.parse::<kw::notify>()?;
                let expr = value(input, "notify", key_span)?;
                set(&mut args.notify, expr, "notify", key_span)?;
            } else if lookahead.peek(kw::on_report) {
                input.parse::<kw::on_report>()?;
                let expr = value(input, "on_report", key_span)?;
                set(&mut args.on_report, expr, "on_report", key_span)?;
            } else if lookahead.peek(kw::agree) {
                input.parse::<kw::agree>()?;
                let expr = value(input, "agree", key_span)?;
                set(&mut args.agree, expr, "agree", key_span)?;
            } else if lookahead.peek(kw::max_attempts) {
                input.parse::<kw::max_attempts>()?;
                let expr = value(input, "max_attempts", key_span)?;
                reject_zero_or_negative(&expr, "max_attempts")?;
                set(&mut args.max_attempts, expr, "max_attempts", key_span)?;
            } else if lookahead.peek(kw::release) {
                input.parse::<kw::release>()?;
                let expr = value(input, "release", key_span)?;
                set(&mut args.release, expr, "release", key_span)?;
            } else if lookahead.peek(Token![crate]) {
                input.parse::<Token![crate]>()?;
                let path = crate_path(input, key_span)?;
                set(&mut args.krate, path, "crate", key_span)?;
            } else if input.peek(syn::Ident) || input.peek(Token![=]) {
                let unknown: proc_macro2::TokenTree = input.parse()?;
                let written = unknown.to_string();
                let hint = closest_key(&written)
                    .map(|key| format!(" (did you mean `{key}`?)"))
                    .unwrap_or_default();
                return Err(syn::Error::new(
                    unknown.span(),
                    format!("unknown argument `{written}`{hint}; expected one of: {VALID_KEYS}"),
                ));
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        if let (Some(span), Some(other)) = (margin_span, factor_or_reduce) {
            return Err(syn::Error::new(
                span,
                format!(
                    "`margin` tunes the guided default, which `{other}` replaces: give one of them"
                ),
            ));
        }
        if let (Some(dir), None) = (&args.cache_dir, &args.cache) {
            return Err(syn::Error::new_spanned(
                dir,
                "`cache_dir` says where the cache is kept, but nothing is cached without `cache = KEY`: add e.g. `cache = \"train\"` beside it",
            ));
        }
        Ok(args)
    }
}

const KEYS: [&str; 17] = [
    "starting",
    "cache",
    "cache_dir",
    "effective",
    "min",
    "factor",
    "reduce",
    "policy",
    "margin",
    "max_attempts",
    "release",
    "when",
    "notify",
    "on_report",
    "agree",
    "remedies",
    "crate",
];

/// The valid key a misspelt one most likely meant: one that starts it or that it starts, or
/// one within two edits.
fn closest_key(written: &str) -> Option<&'static str> {
    let written = written.to_lowercase();
    KEYS.iter()
        .map(|key| {
            let distance =
                if written.len() >= 3 && (key.starts_with(&written) || written.starts_with(key)) {
                    0
                } else {
                    edit_distance(&written, key)
                };
            (distance, *key)
        })
        .filter(|(distance, _)| *distance <= 2)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, key)| key)
}

/// Levenshtein distance over bytes (the keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.as_bytes().iter().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}

/// `factor`, `reduce` and `policy` each choose the sizes: only one may be given.
fn two_size_choices(span: Span, first: &str, second: &str) -> syn::Error {
    let (first, second) = if first == "factor" || second == "policy" {
        (first, second)
    } else {
        (second, first)
    };
    syn::Error::new(
        span,
        format!("`{first}` and `{second}` both choose the next size: give one of them"),
    )
}

/// `crate = path::to::runtime` or, as tokio-macros takes it, `crate = "path::to::runtime"`.
fn crate_path(input: ParseStream<'_>, key_span: Span) -> syn::Result<Path> {
    expect_eq(
        input,
        key_span,
        "expected `=` after `crate`: write `crate = path::to::runtime`",
    )?;
    if input.peek(LitStr) {
        let text: LitStr = input.parse()?;
        return text.parse_with(Path::parse_mod_style).map_err(|_| {
            syn::Error::new(
                text.span(),
                format!(
                    "`crate = {:?}` is not a path: write the path to the runtime, such as `crate = \"my_crate::runtime\"`",
                    text.value()
                ),
            )
        });
    }
    Path::parse_mod_style(input)
}

/// An integer literal, possibly negated, as a signed value.
fn integer_literal(expr: &Expr) -> Option<i128> {
    match expr {
        Expr::Lit(ExprLit {
            lit: Lit::Int(int), ..
        }) => int.base10_parse::<i128>().ok(),
        Expr::Unary(ExprUnary {
            op: UnOp::Neg(_),
            expr: inner,
            ..
        }) => integer_literal(inner).map(|value| -value),
        Expr::Paren(paren) => integer_literal(&paren.expr),
        Expr::Group(group) => integer_literal(&group.expr),
        _ => None,
    }
}

fn reject_zero_or_negative(expr: &Expr, key: &str) -> syn::Result<()> {
    // `new_spanned`: the caret covers all of `-8`, not only the sign.
    match integer_literal(expr) {
        Some(0) => Err(syn::Error::new_spanned(
            expr,
            match key {
                "starting" => "`starting = 0` would never call the function: start from a positive batch size".to_owned(),
                "min" => "`min = 0` would let the search call the function with 0: the smallest useful minimum is 1 (the default)".to_owned(),
                _ => format!("`{key}` must be at least 1"),
            },
        )),
        Some(value) if value < 0 => Err(syn::Error::new_spanned(
            expr,
            format!("`{key}` must be a positive integer, got {value}"),
        )),
        _ => Ok(()),
    }
}

/// A literal factor is checked here; an expression is checked when the search starts.
fn check_factor(expr: &Expr) -> syn::Result<()> {
    let literal = match expr {
        Expr::Lit(ExprLit { lit, .. }) => Some(lit),
        _ => None,
    };
    let value = match literal {
        Some(Lit::Float(float)) => float.base10_parse::<f64>().ok(),
        Some(Lit::Int(int)) => int.base10_parse::<f64>().ok(),
        Some(other) => {
            return Err(syn::Error::new(
                other.span(),
                "`factor` must be a number strictly between 0 and 1, such as `factor = 0.9`",
            ))
        }
        None => match integer_literal(expr) {
            Some(value) => Some(value as f64),
            None => match expr {
                Expr::Unary(ExprUnary {
                    op: UnOp::Neg(_), ..
                }) => Some(-1.0),
                _ => None,
            },
        },
    };
    match value {
        Some(value) if !(value > 0.0 && value < 1.0) => Err(syn::Error::new_spanned(
            expr,
            format!(
                "`factor` must be strictly between 0 and 1 (the size is multiplied by it after each failure), got {}",
                source_text(expr)
            ),
        )),
        _ => Ok(()),
    }
}

/// A literal margin is checked here: the guided policy keeps `0 ≤ margin < 1` of each estimate.
fn check_margin(expr: &Expr) -> syn::Result<()> {
    let value = match expr {
        Expr::Lit(ExprLit {
            lit: Lit::Float(float),
            ..
        }) => float.base10_parse::<f64>().ok(),
        Expr::Lit(ExprLit {
            lit: Lit::Int(int), ..
        }) => int.base10_parse::<f64>().ok(),
        Expr::Lit(ExprLit { lit, .. }) => {
            return Err(syn::Error::new(
                lit.span(),
                "`margin` must be a number at least 0 and below 1, such as `margin = 0.05`",
            ))
        }
        Expr::Unary(ExprUnary {
            op: UnOp::Neg(_), ..
        }) => Some(-1.0),
        _ => None,
    };
    match value {
        Some(value) if !(0.0..1.0).contains(&value) => Err(syn::Error::new_spanned(
            expr,
            format!(
                "`margin` must be at least 0 and below 1 (the share of each estimate kept free), got {}",
                source_text(expr)
            ),
        )),
        _ => Ok(()),
    }
}

/// The expression as written, `-0.5` rather than the token printer's `- 0.5`.
fn source_text(expr: &Expr) -> String {
    match expr {
        Expr::Unary(ExprUnary {
            op: UnOp::Neg(_),
            expr: inner,
            ..
        }) => format!("-{}", source_text(inner)),
        other => quote::ToTokens::to_token_stream(other).to_string(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn expr(text: &str) -> Expr {
        syn::parse_str(text).unwrap()
    }

    #[test]
    fn misspelt_keys_suggest_the_closest() {
        assert_eq!(closest_key("minimum"), Some("min"));
        assert_eq!(closest_key("startng"), Some("starting"));
        assert_eq!(closest_key("max_attempt"), Some("max_attempts"));
        assert_eq!(closest_key("polcy"), Some("policy"));
        assert_eq!(closest_key("on_reprt"), Some("on_report"));
        assert_eq!(closest_key("zzzzzz"), None);
    }

    #[test]
    fn literal_integers_are_read_through_signs_and_parentheses() {
        assert_eq!(integer_literal(&expr("8")), Some(8));
        assert_eq!(integer_literal(&expr("-8")), Some(-8));
        assert_eq!(integer_literal(&expr("(-(4))")), Some(-4));
        assert_eq!(integer_literal(&expr("cfg.batch_size")), None);
    }

    #[test]
    fn zero_and_negative_literals_are_refused_with_the_key_named() {
        let zero_min = reject_zero_or_negative(&expr("0"), "min").unwrap_err();
        assert!(zero_min.to_string().starts_with("`min = 0`"));
        let negative = reject_zero_or_negative(&expr("-3"), "max_attempts").unwrap_err();
        assert_eq!(
            negative.to_string(),
            "`max_attempts` must be a positive integer, got -3"
        );
        assert!(reject_zero_or_negative(&expr("n - 1"), "min").is_ok());
    }

    #[test]
    fn factors_outside_zero_one_are_refused_as_written() {
        assert!(check_factor(&expr("0.9")).is_ok());
        assert!(check_factor(&expr("ratio")).is_ok()); // checked at run time
        let error = check_factor(&expr("-0.5")).unwrap_err();
        assert!(error.to_string().ends_with("got -0.5"), "{error}");
        assert!(check_factor(&expr("1")).is_err());
        assert!(check_factor(&expr("\"0.5\"")).is_err());
    }

    #[test]
    fn size_choices_exclude_each_other_in_a_stable_order() {
        let span = Span::call_site();
        assert_eq!(
            two_size_choices(span, "factor", "reduce").to_string(),
            "`factor` and `reduce` both choose the next size: give one of them"
        );
        assert_eq!(
            two_size_choices(span, "reduce", "factor").to_string(),
            "`factor` and `reduce` both choose the next size: give one of them"
        );
        assert_eq!(
            two_size_choices(span, "reduce", "policy").to_string(),
            "`reduce` and `policy` both choose the next size: give one of them"
        );
    }

    #[test]
    fn every_key_parses_once_and_duplicates_are_refused() {
        let args: Args = syn::parse_str(
            "starting = 8, min = 2, policy = p, max_attempts = 3, release = r, when = w, notify = n, on_report = o, crate = rt",
        )
        .unwrap();
        assert!(args.starting.is_some() && args.policy.is_some() && args.on_report.is_some());
        let duplicate = syn::parse_str::<Args>("starting = 8, starting = 4")
            .err()
            .unwrap();
        assert_eq!(
            duplicate.to_string(),
            "duplicate argument `starting`: give it once"
        );
    }
}
