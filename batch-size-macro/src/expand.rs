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
        match (&args.remedies, split.batch_size.is_remedied) {
            (None, true) => signature::combine(
                &mut error,
                syn::Error::new_spanned(
                    &split.batch_size.ty,
                    "a `Remedied` parameter needs `remedies = ...`: the `Remedies` the search may apply when no batch size fits, e.g. `#[find_executable_batch_size(starting = 8, remedies = ladder.clone())]`",
                ),
            ),
            (Some(remedies), false) => signature::combine(
                &mut error,
                syn::Error::new_spanned(
                    remedies,
                    "`remedies` hands each attempt its batch size and settings: make the first parameter `attempt: Remedied<YourSettings>` (`attempt.batch_size()`, `attempt.settings()`)",
                ),
            ),
            (Some(remedies), true) if args.effective.is_some() => signature::combine(
                &mut error,
                syn::Error::new_spanned(
                    remedies,
                    "`remedies` and `effective` cannot be combined in the attribute yet: use `EffectiveBatch::new(..).with_remedies(&remedies)` for a training loop",
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
    let rebind = split.rebind.iter().map(|rebinding| &rebinding.sync);
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
    let shape = signature::return_shape(&function.sig.output);

    // Locals of the generated code are hygienic: the body can neither see nor shadow them.
    let size = quote_spanned!(Span::mixed_site()=> __batch_size);
    let effective = quote_spanned!(Span::mixed_site()=> __batch_size_effective);
    let is_plan = split.batch_size.is_plan;
    let is_remedied = split.batch_size.is_remedied;
    let remedies = quote_spanned!(Span::mixed_site()=> __batch_size_remedies);
    let size_ty: syn::Type = if is_plan || is_remedied {
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
    // Evaluated at each call, as `starting` is; the attempts share one handle on its state.
    let remedies_value = args.remedies.as_ref().filter(|_| is_remedied).map(|value| {
        let handle = spans::call_over(
            quote! { #private::remedies_handle },
            quote! { &(#value) },
            value,
        );
        quote! { let #remedies = #handle; }
    });
    if remedies_value.is_some() {
        search = quote! { #private::with_remedies(#search, &#remedies) };
    }

    // Over the parameter's type, like the builder's check of it, so that a type that cannot be
    // a batch size gives one error there.
    let batch_size_as = if is_plan {
        quote! { #private::plan(&#effective, #size) }
    } else if is_remedied {
        quote! { #remedies.attempt(#size) }
    } else {
        let cast = spans::over(quote! { #private::batch_size_as::<#batch_ty> }, batch_ty);
        quote! { #cast(#size) }
    };
    let is_async = function.sig.asyncness.is_some();
    let mut_receiver = function
        .sig
        .receiver()
        .is_some_and(|receiver| receiver.mutability.is_some());
    let sync = split.rebind.iter().map(|rebinding| &rebinding.sync);
    // The body's statements, not its block: a one-line body `{ Ok(batch_size) }` nested as a
    // block would draw `unused_braces` at the user's own braces.
    let block = &block.stmts;
    // The body is the attempt: `return` and `?` end the attempt with the function's type.
    let (before, attempt) = if !is_async {
        let attempt = quote! {
            |#size| {
                let #batch_pat: #batch_ty = #batch_size_as;
                #(#sync)*
                #(#block)*
            }
        };
        (TokenStream::new(), attempt)
    } else if mut_receiver {
        // `self` cannot be rebound, so `&mut self` is lent by an async closure (whose future
        // rustc cannot yet prove `Send`, rust-lang/rust#110338).
        let attempt = quote! {
            async |#size| {
                let #batch_pat: #batch_ty = #batch_size_as;
                #(#sync)*
                #(#block)*
            }
        };
        (TokenStream::new(), attempt)
    } else {
        // A closure returning an `async move` block: `Send` when the body is.
        let before = split.rebind.iter().map(|rebinding| &rebinding.before);
        let in_closure = split.rebind.iter().map(|rebinding| &rebinding.in_closure);
        let in_future = split.rebind.iter().map(|rebinding| &rebinding.in_future);
        // The batch size (or plan) is made in the closure, from what it borrows (`effective`),
        // and moved into the attempt's future.
        let attempt = quote! {
            move |#size| {
                let #batch_pat: #batch_ty = #batch_size_as;
                #(#in_closure)*
                async move {
                    #(#in_future)*
                    #(#block)*
                }
            }
        };
        (quote! { #(#before)* }, attempt)
    };
    let call = match (&shape.inferable, is_async) {
        // The return type with `_` for any `impl Trait` in it, as an expression: the macro
        // picks the classification and the give-up by type, so a `Result` behind an alias is
        // found too. Over the return type, so that an error type that cannot be classified is
        // reported there.
        (Some(ret), _) => {
            let ret = spans::over(quote! { ::core::marker::PhantomData::<#ret> }, &shape.ty);
            let (drive, lending) = match (is_async, mut_receiver) {
                (false, _) => (quote! { drive_attempts }, None),
                (true, false) => (quote! { drive_attempts_async }, None),
                (true, true) => (quote! { drive_attempts_async }, Some(quote! { @lending })),
            };
            // The call over the return type, where an error type that cannot be classified is
            // reported (rustc points at the macro's call); a `crate = ...` path keeps its own
            // spans, so that a wrong one is reported there.
            match &args.krate {
                None => spans::call_over(
                    quote! { #private::#drive! },
                    quote! { #lending #ret, #search, #attempt },
                    &shape.ty,
                ),
                Some(_) => {
                    let drive = spans::over(drive, &shape.ty);
                    quote! { #private::#drive!(#lending #ret, #search, #attempt) }
                }
            }
        }
        // `impl Trait`: not a `Result`, so only a panic can be out-of-memory.
        (None, false) => quote! { #private::drive_panics(#search, #attempt) },
        (None, true) => {
            let shape = if mut_receiver {
                quote! { Lending }
            } else {
                quote! { Returning }
            };
            quote! { #private::drive_panics_async(#search, #private::#shape(#attempt)).await }
        }
    };

    quote! {
        #(#attrs)*
        #vis #outer {
            #effective_value
            #remedies_value
            #before
            #call
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

    /// The expansion as rustfmt prints it.
    fn rustfmt(expansion: &proc_macro2::TokenStream) -> String {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let mut child = Command::new("rustfmt")
            .args(["--edition", "2021", "--emit", "stdout"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("rustfmt, from the Rust toolchain, formats the pinned expansion");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(expansion.to_string().as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{expansion}");
        String::from_utf8(output.stdout).unwrap()
    }

    #[test]
    fn a_plain_function_expands_to_one_call_of_the_engine() {
        // tests-build/ui/pass/accepted/free_fn.rs
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
        // The whole expansion, pinned: the protocol (begin, classify, record, release, decide)
        // lives in the runtime's `drive_attempts!`; the macro writes the search, the re-borrows and the
        // body as a closure.
        let expected = r#"fn train(limit: usize) -> anyhow::Result<usize> {
    ::batch_size_runtime::__private::drive_attempts!(
        ::core::marker::PhantomData::<anyhow::Result<usize>>,
        ::batch_size_runtime::__private::search::<usize>(
            ::core::concat!(::core::module_path!(), "::", "train"),
            ::batch_size_runtime::__private::starting_of(128),
        ),
        |__batch_size| {
            let batch_size: usize =
                ::batch_size_runtime::__private::batch_size_as::<usize>(__batch_size);
            let limit = ::batch_size_runtime::__private::ClonePerAttempt::clone_for_attempt(&limit);
            if batch_size > limit {
                return Err(OutOfMemory::new().into());
            }
            Ok(batch_size)
        }
    )
}
"#;
        let formatted = rustfmt(&expansion);
        assert_eq!(formatted, expected);
        assert!(formatted.lines().count() <= 20);
        let names: Vec<&str> = [
            "ClonePerAttempt", // `limit`, owned, is cloned for each attempt
            "batch_size_as",
            "drive_attempts",
            "search",
            "starting_of",
        ]
        .to_vec();
        let found = private_items(&expansion);
        assert_eq!(found.iter().map(String::as_str).collect::<Vec<_>>(), names);
    }

    #[test]
    fn the_readmes_function_expands_to_at_most_20_lines_naming_at_most_6_items() {
        // README.md's first snippet, as a user writes it (candle's own `Result` and `Device`):
        // 18 lines, naming drive_attempts, search, starting_of and batch_size_as.
        let expansion = find_executable_batch_size(
            quote! { starting = 256 },
            quote! {
                fn train(batch_size: usize, device: &Device) -> Result<f32> {
                    let inputs = Tensor::randn(0f32, 1.0, (batch_size, 64), device)?;
                    let weights = Tensor::randn(0f32, 0.1, (64, 8), device)?;
                    let loss = inputs.matmul(&weights)?.sqr()?.mean_all()?;
                    loss.to_scalar::<f32>()
                }
            },
        );
        let formatted = rustfmt(&expansion);
        let lines = formatted.lines().count();
        assert!(lines <= 20, "{lines} lines:\n{formatted}");
        let found = private_items(&expansion);
        assert!(found.len() <= 6, "{found:?}");
    }

    #[test]
    fn owned_borrowed_and_mut_parameters_expand_to_at_most_20_lines_naming_at_most_6_items() {
        // A 6-line function with one parameter of each kind: owned (cloned per attempt),
        // borrowed and `&mut` (re-borrowed per attempt).
        let expansion = find_executable_batch_size(
            quote! { starting = 128 },
            quote! {
                fn train(batch_size: usize, limit: usize, data: &[f32], model: &mut Model) -> anyhow::Result<usize> {
                    model.step(&data[..batch_size.min(data.len())])?;
                    if batch_size > limit {
                        return Err(OutOfMemory::new().into());
                    }
                    Ok(batch_size)
                }
            },
        );
        let formatted = rustfmt(&expansion);
        let lines = formatted.lines().count();
        assert!(lines <= 20, "{lines} lines:\n{formatted}");
        let found = private_items(&expansion);
        assert!(found.len() <= 6, "{found:?}");
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
            quote! { starting = cfg.batch_size.min(budget) },
            quote! { fn train(batch_size: usize, cfg: &Config, budget: usize, epochs: usize) -> usize { batch_size } },
        );
        let text = expansion.to_string();
        // An owned one is cloned for each attempt, and its clone may go unused.
        assert!(
            text.contains("# [allow (unused_variables)] let budget = "),
            "{text}"
        );
        // A shared reference is used as it is: nothing to allow.
        assert!(!text.contains("let cfg"), "{text}");
        assert!(text.contains("let epochs = "), "{text}");
        assert!(
            !text.contains("# [allow (unused_variables)] let epochs"),
            "{text}"
        );
    }
}
