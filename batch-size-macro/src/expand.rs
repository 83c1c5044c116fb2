//! Code generation: the rewritten function drives the runtime's search state machine, running
//! the user's body once per attempt.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{parse_quote, ItemFn};

use crate::args::Args;
use crate::signature::{self, ReturnShape, Split};
use crate::spans;

pub(crate) fn find_executable_batch_size(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(_) => {
            let error = syn::Error::new(
                item_span(&item),
                "#[find_executable_batch_size] applies to a function (or method) whose first parameter is the batch size",
            );
            return with_error(item, error);
        }
    };
    let parsed_args = syn::parse2::<Args>(args);
    let krate: syn::Path = match &parsed_args {
        Ok(Args {
            krate: Some(path), ..
        }) => path.clone(),
        _ => parse_quote!(::batch_size_runtime),
    };
    let private = private_module(&krate);
    let split = match signature::split(&function.sig, &private) {
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

/// The rewritten signature over the original body, for when the attribute cannot apply:
/// callers (which already omit the batch size) and the body still type-check, and nothing
/// diverges before the body, so its parameters count as used and no lint fires.
fn placeholder(function: &ItemFn, split: &Split) -> TokenStream {
    let ItemFn {
        attrs, vis, block, ..
    } = function;
    let outer = &split.outer;
    let pat = &split.batch_size.pat;
    let ty = &split.batch_size.ty;
    let rebind = &split.rebind;
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
                #(#rebind)*
                #block
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
    let name = function.sig.ident.to_string();
    let shape = signature::return_shape(&function.sig.output);
    let ret = &shape.ty;

    // Locals of the generated code are hygienic: the body can neither see nor shadow them.
    let search = quote_spanned!(Span::mixed_site()=> __batch_size_search);
    let builder = quote_spanned!(Span::mixed_site()=> __batch_size_builder);
    let next = quote_spanned!(Span::mixed_site()=> __batch_size_next);
    let none_fit = quote_spanned!(Span::mixed_site()=> __batch_size_none_fit);
    let caught = quote_spanned!(Span::mixed_site()=> __batch_size_caught);
    let value = quote_spanned!(Span::mixed_site()=> __batch_size_value);
    let tag = quote_spanned!(Span::mixed_site()=> __batch_size_tag);
    let found = quote_spanned!(Span::mixed_site()=> __batch_size_found);
    let kept = quote_spanned!(Span::mixed_site()=> __batch_size_kept);
    let described = quote_spanned!(Span::mixed_site()=> __batch_size_described);
    let payload = quote_spanned!(Span::mixed_site()=> __batch_size_payload);

    let batch_size_int = quote_spanned! {batch_ty.span()=>
        <#batch_ty as #private::BatchSizeInt>
    };
    // Laid over the argument: a value of the wrong type is reported under it.
    let starting = spans::call_over(
        quote! { #private::starting_of },
        starting.to_token_stream(),
        starting,
    );
    let min = args.min.as_ref().map(|min| {
        let min = spans::call_over(quote! { #private::min_of }, min.to_token_stream(), min);
        quote! { let #builder = #builder.with_min(#min); }
    });
    let reduction = match (&args.factor, &args.reduce) {
        (Some(factor), _) => Some(quote_spanned! {factor.span()=>
            let #builder = #builder.with_factor(::core::convert::Into::<f64>::into(#factor));
        }),
        (None, Some(reduce)) => Some(quote_spanned! {reduce.span()=>
            let #builder = #builder.with_reduce(#reduce);
        }),
        (None, None) => None,
    };
    let max_attempts = args.max_attempts.as_ref().map(|max| {
        let max = spans::call_over(
            quote! { #private::max_attempts_of },
            max.to_token_stream(),
            max,
        );
        quote! { let #builder = #builder.with_max_attempts(#max); }
    });
    let release = args.release.as_ref().map(|release| {
        quote_spanned! {release.span()=> let #builder = #builder.with_release(#release); }
    });

    let give_up = give_up(&shape, private, &none_fit);
    let typed = shape.nameable.then(|| quote! { ::<#ret, _> });

    let attempt = quote! {
        let #batch_pat: #batch_ty = #batch_size_int::from_batch_size(#next);
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
            let mut #search = {
                let #builder = #private::search_for::<#batch_ty>(
                    ::core::concat!(::core::module_path!(), "::", #name),
                    #starting,
                );
                #min
                #reduction
                #max_attempts
                #release
                #builder.start()
            };
            loop {
                let #next: usize = match #search.begin() {
                    ::core::result::Result::Ok(#next) => #next,
                    ::core::result::Result::Err(#none_fit) => #give_up,
                };
                let #caught = #run_attempt;
                match #caught {
                    ::core::result::Result::Ok(#value) => {
                        #[allow(unused_imports)]
                        use #private::judges::*;
                        let #tag = #private::tag_of(&#value);
                        match (&&&&&&&#tag).judge(#value) {
                            #private::Verdict::Return(#value) => {
                                #search.succeeded();
                                return #value;
                            }
                            #private::Verdict::ReturnError(#value, #described) => {
                                #search.failed_described(#described);
                                return #value;
                            }
                            #private::Verdict::OutOfMemory(#found, #kept) => {
                                #search.out_of_memory_kept(#found, #kept);
                            }
                        }
                    }
                    ::core::result::Result::Err(#payload) => #search.panicked(#payload),
                }
            }
        }
    }
}

/// What the function does when no size fits: return the error, or panic with it where the
/// return type cannot hold it.
fn give_up(shape: &ReturnShape, private: &syn::Path, none_fit: &TokenStream) -> TokenStream {
    let ret = &shape.ty;
    if shape.nameable {
        // The ladder picks, by type (so a `Result` behind an alias is found too), the first
        // conversion the error type has: `From<NoExecutableBatchSize>`, `From<io::Error>`,
        // `From<String>`; a `Result` with none of them is reported at the return type.
        let kind = spans::over(
            quote! { (&&&&&#private::tag::<#ret>()).give_up_kind() },
            ret,
        );
        let call = spans::call_over(
            quote! { #private::give_up_as },
            quote! { #kind, #none_fit },
            ret,
        );
        quote! {{
            #[allow(unused_imports)]
            use #private::judges::*;
            return #call;
        }}
    } else if shape.is_result {
        // Laid over the return type: an error type without `From<NoExecutableBatchSize>` is
        // reported there, with the runtime's `on_unimplemented` message.
        let call = spans::call_over(quote! { #private::give_up_result }, none_fit.clone(), ret);
        quote! { return #call }
    } else {
        // Diverges: no `return`, which would be unreachable.
        quote! { #private::panic_no_executable_batch_size(#none_fit) }
    }
}
