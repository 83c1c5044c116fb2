//! Code generation: the rewritten function builds the search from the arguments and runs the
//! user's body once per attempt through the runtime's driver, which owns the protocol.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use std::collections::HashSet;
use syn::spanned::Spanned;

use syn::{parse_quote, ItemFn};

use crate::args::Args;
use crate::signature::{self, Split};
use crate::spans;

pub(crate) fn find_executable_batch_size(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(_) => return unparsed_body(item, args),
    };
    let used_by_args = idents_in(&args);
    let parsed_args = syn::parse2::<Args>(args);
    let krate: syn::Path = match &parsed_args {
        Ok(Args {
            krate: Some(path), ..
        }) => path.clone(),
        _ => parse_quote!(::batch_size_runtime),
    };
    let private = private_module(&krate);
    let split = match signature::split(&function.sig, &private, &used_by_args) {
        Ok(split) => split,
        Err(mut error) => {
            if let Err(args_error) = parsed_args {
                error.combine(args_error);
            }
            return with_error(function.to_token_stream(), error);
        }
    };
    // Every error at once; with any, the function keeps its rewritten signature over its body.
    let mut error = split.error.clone();
    let args = match parsed_args {
        Ok(args) => Some(args),
        Err(args_error) => {
            signature::combine(&mut error, args_error);
            None
        }
    };
    if let Some(Args { starting: None, .. }) = &args {
        signature::combine(&mut error, missing_starting());
    }
    if let Some(args) = &args {
        match (&args.effective, split.batch_size.is_plan) {
            (None, true) => signature::combine(
                &mut error,
                syn::Error::new_spanned(
                    &split.batch_size.ty,
                    "a `BatchPlan` parameter needs `effective = ...`: the batch its micro-batches add up to, e.g. `#[find_executable_batch_size(starting = 32, effective = 256)]`",
                ),
            ),
            (Some(effective), false) => signature::combine(
                &mut error,
                syn::Error::new_spanned(
                    effective,
                    "`effective` hands each attempt a `BatchPlan` of micro-batches: make the first parameter `plan: BatchPlan` (`starting` is then the first micro-batch size)",
                ),
            ),
            _ => {}
        }
    }
    match (error, &args) {
        (
            None,
            Some(
                args @ Args {
                    starting: Some(starting),
                    ..
                },
            ),
        ) => rewrite(&function, &split, args, starting, &private),
        (Some(error), _) => with_error(placeholder(&function, &split), error),
        (None, _) => with_error(placeholder(&function, &split), missing_starting()),
    }
}

/// `krate::__private`, its last segment at the path's last token, so that a `crate = path`
/// without it is reported under the path.
fn private_module(krate: &syn::Path) -> syn::Path {
    let span = krate
        .segments
        .last()
        .map_or_else(Span::call_site, |last| last.ident.span());
    let mut private = krate.clone();
    private
        .segments
        .push(syn::PathSegment::from(syn::Ident::new("__private", span)));
    private
}

fn missing_starting() -> syn::Error {
    syn::Error::new(
        Span::call_site(),
        "missing `starting = ...`: the batch size to try first, e.g. `#[find_executable_batch_size(starting = 128)]`",
    )
}

/// The span of the item's first token, for "this is not a function".
fn item_span(item: &TokenStream) -> Span {
    item.clone()
        .into_iter()
        .find(|token| !matches!(token, proc_macro2::TokenTree::Punct(p) if p.as_char() == '#'))
        .map_or_else(Span::call_site, |token| token.span())
}

/// The error beside the item, so that the rest of the crate and IDEs keep working and the user
/// sees this one error, not one per caller.
fn with_error(item: TokenStream, error: syn::Error) -> TokenStream {
    let error = error.to_compile_error();
    quote! { #error #item }
}

/// A function whose signature parses but whose body does not (tracing-attributes'
/// `MaybeItemFn`): the rewritten signature over the body's tokens, so that rustc reports the one
/// syntax error and callers, which already omit the batch size, raise none of their own.
fn unparsed_body(item: TokenStream, args: TokenStream) -> TokenStream {
    let not_a_function = || {
        let error = syn::Error::new(
            item_span(&item),
            "#[find_executable_batch_size] applies to a function (or method) whose first parameter is the batch size",
        );
        with_error(item.clone(), error)
    };
    let Ok(function) = syn::parse2::<MaybeItemFn>(item.clone()) else {
        return not_a_function();
    };
    let krate: syn::Path = match syn::parse2::<Args>(args) {
        Ok(Args {
            krate: Some(path), ..
        }) => path,
        _ => parse_quote!(::batch_size_runtime),
    };
    match signature::split(&function.sig, &private_module(&krate), &HashSet::new()) {
        Ok(split) => placeholder_over(&function.attrs, &function.vis, &split, function.body),
        Err(_) => not_a_function(),
    }
}

/// A function item whose body is kept as tokens.
struct MaybeItemFn {
    attrs: Vec<syn::Attribute>,
    vis: syn::Visibility,
    sig: syn::Signature,
    body: TokenStream,
}

impl syn::parse::Parse for MaybeItemFn {
    fn parse(input: syn::parse::ParseStream<'_>) -> syn::Result<Self> {
        Ok(MaybeItemFn {
            attrs: input.call(syn::Attribute::parse_outer)?,
            vis: input.parse()?,
            sig: input.parse()?,
            body: input.parse()?,
        })
    }
}

/// Every identifier in the attribute's arguments: a parameter named there is used by the
/// attribute (`starting = cfg.batch_size`), so its copy in the body may go unused.
fn idents_in(tokens: &TokenStream) -> HashSet<String> {
    let mut found = HashSet::new();
    let mut stack = vec![tokens.clone()];
    while let Some(stream) = stack.pop() {
        for token in stream {
            match token {
                proc_macro2::TokenTree::Ident(ident) => {
                    found.insert(ident.to_string());
                }
                proc_macro2::TokenTree::Group(group) => stack.push(group.stream()),
                // `format!("{key}")` names `key` inside a string.
                proc_macro2::TokenTree::Literal(literal) => {
                    let text = literal.to_string();
                    for part in text.split('{').skip(1) {
                        let name: String = part
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if !name.is_empty() {
                            found.insert(name);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    found
}

/// The rewritten signature over the original body, for when the attribute cannot apply:
/// callers (which already omit the batch size) and the body still type-check, and nothing
/// diverges before the body, so its parameters count as used and no lint fires.
fn placeholder(function: &ItemFn, split: &Split) -> TokenStream {
    let rebind = &split.rebind;
    let block = &function.block;
    placeholder_over(
        &function.attrs,
        &function.vis,
        split,
        quote! { #(#rebind)* #block },
    )
}

/// The rewritten signature over `body`, with the batch size bound to a value that never
/// exists (nothing runs before the body diverges).
fn placeholder_over(
    attrs: &[syn::Attribute],
    vis: &syn::Visibility,
    split: &Split,
    body: TokenStream,
) -> TokenStream {
    let outer = &split.outer;
    let pat = &split.batch_size.pat;
    let ty = &split.batch_size.ty;
    let value = quote_spanned!(Span::mixed_site()=> __batch_size_placeholder);
    quote! {
        #(#attrs)*
        #vis #outer {
            #[allow(unused_variables, clippy::all)]
            {
                fn #value<T>() -> T {
                    ::core::unreachable!()
                }
                let #pat: #ty = #value::<#ty>();
                #body
            }
        }
    }
}

fn rewrite(
    function: &ItemFn,
    split: &Split,
    args: &Args,
    starting: &syn::Expr,
    private: &syn::Path,
) -> TokenStream {
    let ItemFn {
        attrs, vis, block, ..
    } = function;
    let outer = &split.outer;
    let batch_pat = &split.batch_size.pat;
    let batch_ty = &split.batch_size.ty;
    let rebind = &split.rebind;
    let shape = signature::return_shape(&function.sig.output);

    // Locals of the generated code are hygienic: the body can neither see nor shadow them.
    let driver = quote_spanned!(Span::mixed_site()=> __batch_size_driver);
    let size = quote_spanned!(Span::mixed_site()=> __batch_size);
    let value = quote_spanned!(Span::mixed_site()=> __batch_size_value);

    let effective = quote_spanned!(Span::mixed_site()=> __batch_size_effective);
    let is_plan = split.batch_size.is_plan;
    let size_ty: syn::Type = if is_plan {
        parse_quote!(usize)
    } else {
        batch_ty.clone()
    };
    let mut search = search_builder(args, starting, &size_ty, private, &function.sig.ident);
    let effective_value = args.effective.as_ref().filter(|_| is_plan).map(|value| {
        let value = spans::call_over(
            quote! { #private::starting_of },
            value.to_token_stream(),
            value,
        );
        quote! { let #effective = #value; }
    });
    if effective_value.is_some() {
        search = quote! { #private::with_effective(#search, &#effective) };
    }
    let (driver_new, typed) = match &shape.inferable {
        // The return type with `_` for any `impl Trait` in it: the ladders pick the
        // classification and the give-up by type, so a `Result` behind an alias is found too.
        Some(ret) => {
            let classify = spans::over(
                quote! { (&&&&&&&#private::tag::<#ret>()).batch_size_classify_kind() },
                &shape.ty,
            );
            let give_up = spans::over(
                quote! { (&&&&&&#private::tag::<#ret>()).batch_size_give_up_kind() },
                &shape.ty,
            );
            let new = spans::call_over(
                quote! { #private::Driver::<#ret, _, _>::new },
                quote! { #driver, #classify, #give_up },
                &shape.ty,
            );
            (
                quote! {{
                    #[allow(unused_imports)]
                    use #private::ladder::*;
                    #new
                }},
                Some(quote! { ::<#ret, _> }),
            )
        }
        // `impl Trait`: not a `Result`, so only a panic can be out-of-memory.
        None => (
            quote! { #private::Driver::new(#driver, #private::PanicOnly::new(), #private::PanicWithError::new()) },
            None,
        ),
    };

    // Over the parameter's type, like the builder's check of it, so that a type that cannot be
    // a batch size gives one error there.
    let batch_size_as = if is_plan {
        quote! { #private::plan(&#effective, #size) }
    } else {
        let cast = spans::over(quote! { #private::batch_size_as::<#batch_ty> }, batch_ty);
        quote! { #cast(#size) }
    };
    let attempt = quote! {
        let #batch_pat: #batch_ty = #batch_size_as;
        #(#rebind)*
        #block
    };
    let run_attempt = if function.sig.asyncness.is_some() {
        quote! { #private::catch_future #typed (async { #attempt }).await }
    } else {
        quote! { #private::catch_attempt #typed (|| { #attempt }) }
    };

    quote! {
        #(#attrs)*
        #vis #outer {
            #effective_value
            let #driver = #search;
            let mut #driver = #driver_new;
            loop {
                let #size = match #driver.begin() {
                    ::core::result::Result::Ok(#size) => #size,
                    ::core::result::Result::Err(#value) => return #value,
                };
                if let ::core::option::Option::Some(#value) = #driver.settle(#run_attempt) {
                    return #value;
                }
            }
        }
    }
}

/// The builder for the attribute's arguments, each laid over its argument so that a value of
/// the wrong type is reported there.
fn search_builder(
    args: &Args,
    starting: &syn::Expr,
    batch_ty: &syn::Type,
    private: &syn::Path,
    name: &syn::Ident,
) -> TokenStream {
    let name = name.to_string();
    let starting = spans::call_over(
        quote! { #private::starting_of },
        starting.to_token_stream(),
        starting,
    );
    let mut search = quote! {
        #private::search::<#batch_ty>(
            ::core::concat!(::core::module_path!(), "::", #name),
            #starting,
        )
    };
    if let Some(min) = &args.min {
        search = spans::call_over(quote! { #private::with_min }, quote! { #search, #min }, min);
    }
    if let Some(max) = &args.max_attempts {
        search = spans::call_over(
            quote! { #private::with_max_attempts },
            quote! { #search, #max },
            max,
        );
    }
    if let Some(factor) = &args.factor {
        search = quote_spanned! {factor.span()=>
            #search.with_factor(::core::convert::Into::<f64>::into(#factor))
        };
    }
    if let Some(margin) = &args.margin {
        search = quote_spanned! {margin.span()=>
            #search.with_margin(::core::convert::Into::<f64>::into(#margin))
        };
    }
    let methods = [
        ("with_reduce", &args.reduce),
        ("with_policy", &args.policy),
        ("with_release", &args.release),
        ("when", &args.when),
        ("notify", &args.notify),
        ("on_report", &args.on_report),
        ("with_agreement", &args.agree),
        ("with_cache", &args.cache),
        ("with_cache_dir", &args.cache_dir),
    ];
    for (method, argument) in methods {
        if let Some(argument) = argument {
            let method = syn::Ident::new(method, argument.span());
            search = quote_spanned! {argument.span()=> #search.#method(#argument) };
        }
    }
    search
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::BTreeSet;

    use proc_macro2::TokenTree;
    use quote::quote;

    use super::find_executable_batch_size;

    /// The `__private` items an expansion names.
    fn private_items(expansion: &proc_macro2::TokenStream) -> BTreeSet<String> {
        let mut found = BTreeSet::new();
        let mut stack = vec![expansion.clone()];
        while let Some(stream) = stack.pop() {
            let tokens: Vec<TokenTree> = stream.into_iter().collect();
            for (index, token) in tokens.iter().enumerate() {
                match token {
                    TokenTree::Group(group) => stack.push(group.stream()),
                    TokenTree::Ident(ident) if ident == "__private" => {
                        if let Some(TokenTree::Ident(item)) = tokens.get(index + 3) {
                            found.insert(item.to_string());
                        }
                    }
                    _ => {}
                }
            }
        }
        found
    }

    #[test]
    fn a_plain_function_expands_to_a_builder_and_a_driver_loop() {
        // tests/ui/pass/free_fn.rs
        let expansion = find_executable_batch_size(
            quote! { starting = 128 },
            quote! {
                fn train(batch_size: usize, limit: usize) -> anyhow::Result<usize> {
                    if batch_size > limit {
                        return Err(OutOfMemory::new().into());
                    }
                    Ok(batch_size)
                }
            },
        );
        let names: Vec<&str> = [
            "ClonePerAttempt", // `limit`, owned, is cloned for each attempt
            "Driver",
            "batch_size_as",
            "catch_attempt",
            "ladder",
            "search",
            "starting_of",
            "tag",
        ]
        .to_vec();
        let found = private_items(&expansion);
        assert_eq!(found.iter().map(String::as_str).collect::<Vec<_>>(), names);
        // The protocol lives in the runtime: the expansion calls the driver, never the
        // search's own methods.
        let text = expansion.to_string();
        for protocol in ["succeeded", "out_of_memory", "panicked", "failed", "judge"] {
            assert!(!text.contains(protocol), "{protocol} in {text}");
        }
        // 383 tokens today, the user's body (25) included; the loop is in the runtime, so
        // growing past this means protocol is leaking back into generated code.
        let count = count_tokens(&expansion);
        assert!(count < 400, "{count} tokens: {text}");
    }

    fn count_tokens(stream: &proc_macro2::TokenStream) -> usize {
        stream
            .clone()
            .into_iter()
            .map(|token| match token {
                TokenTree::Group(group) => 2 + count_tokens(&group.stream()),
                _ => 1,
            })
            .sum()
    }

    #[test]
    fn a_body_that_does_not_parse_keeps_the_rewritten_signature() {
        let expansion = find_executable_batch_size(
            quote! { starting = 8 },
            quote! { fn train(batch_size: usize, data: &[u8]) -> usize { let x = batch_size + ; x } },
        );
        let text = expansion.to_string();
        assert!(text.contains("fn train (data : & [u8]) -> usize"), "{text}");
        assert!(!text.contains("compile_error"), "{text}");
    }

    #[test]
    fn a_parameter_used_by_the_arguments_may_go_unused_in_the_body() {
        let expansion = find_executable_batch_size(
            quote! { starting = cfg.batch_size },
            quote! { fn train(batch_size: usize, cfg: &Config, epochs: usize) -> usize { batch_size } },
        );
        let text = expansion.to_string();
        assert!(
            text.contains("# [allow (unused_variables)] let cfg = cfg ;"),
            "{text}"
        );
        assert!(text.contains("let epochs = "), "{text}");
        assert!(
            !text.contains("# [allow (unused_variables)] let epochs"),
            "{text}"
        );
    }
}
