//! Code generation: the rewritten function drives the runtime's search state machine, running
//! the user's body once per attempt.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{parse_quote, ItemFn};

use crate::args::Args;
use crate::signature::{self, ReturnShape, Split};

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
    let split = match signature::split(&function.sig, &krate) {
        Ok(split) => split,
        Err(error) => return with_error(function.to_token_stream(), error),
    };
    let args = match parsed_args {
        Ok(args) => args,
        Err(error) => return with_error(placeholder(&function, &split), error),
    };
    let Some(starting) = &args.starting else {
        let error = syn::Error::new(
            Span::call_site(),
            "missing `starting = ...`: the batch size to try first, e.g. `#[find_executable_batch_size(starting = 128)]`",
        );
        return with_error(placeholder(&function, &split), error);
    };
    rewrite(&function, &split, &args, starting, &krate)
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

/// The rewritten signature over the original body, for when the arguments are wrong: callers
/// (which already omit the batch size) and the body still type-check.
fn placeholder(function: &ItemFn, split: &Split) -> TokenStream {
    let ItemFn {
        attrs, vis, block, ..
    } = function;
    let outer = &split.outer;
    let pat = &split.batch_size.pat;
    let ty = &split.batch_size.ty;
    let rebind = &split.rebind;
    quote! {
        #(#attrs)*
        #vis #outer {
            #[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
            {
                let #pat: #ty = ::core::unreachable!();
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
    krate: &syn::Path,
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
        <#batch_ty as #krate::__private::BatchSizeInt>
    };
    let min = args.min.as_ref().map(|min| {
        quote! { let #builder = #builder.with_min(#krate::__private::min_of(#min)); }
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
        quote! {
            let #builder = #builder.with_max_attempts(#krate::__private::max_attempts_of(#max));
        }
    });
    let release = args.release.as_ref().map(|release| {
        quote_spanned! {release.span()=> let #builder = #builder.with_release(#release); }
    });

    let give_up = give_up(&shape, krate, &none_fit);
    let typed = shape.nameable.then(|| quote! { ::<#ret, _> });

    let attempt = quote! {
        let #batch_pat: #batch_ty = #batch_size_int::from_batch_size(#next);
        #(#rebind)*
        #block
    };
    let run_attempt = if function.sig.asyncness.is_some() {
        quote! { #krate::__private::catch_future #typed (async { #attempt }).await }
    } else {
        quote! { #krate::__private::catch_attempt #typed (|| { #attempt }) }
    };

    quote! {
        #(#attrs)*
        #vis #outer {
            let mut #search = {
                let #builder = #krate::__private::search_for::<#batch_ty, _>(
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
                    ::core::result::Result::Err(#none_fit) => return #give_up,
                };
                let #caught = #run_attempt;
                match #caught {
                    ::core::result::Result::Ok(#value) => {
                        #[allow(unused_imports)]
                        use #krate::__private::judges::*;
                        let #tag = #krate::__private::tag_of(&#value);
                        match (&&&&&&&#tag).judge(#value) {
                            #krate::__private::Verdict::Return(#value) => {
                                #search.succeeded();
                                return #value;
                            }
                            #krate::__private::Verdict::ReturnError(#value, #described) => {
                                #search.failed_described(#described);
                                return #value;
                            }
                            #krate::__private::Verdict::OutOfMemory(#found, #kept) => {
                                #search.out_of_memory(#found, #kept);
                            }
                        }
                    }
                    ::core::result::Result::Err(#payload) => #search.panicked(#payload),
                }
            }
        }
    }
}

/// What the function returns when no size fits.
fn give_up(shape: &ReturnShape, krate: &syn::Path, none_fit: &TokenStream) -> TokenStream {
    let ret = &shape.ty;
    if shape.is_result {
        // Spanned on the return type: an error type without `From<NoExecutableBatchSize>` is
        // reported there, with the runtime's `on_unimplemented` message.
        quote_spanned! {shape.span=> #krate::__private::give_up_result(#none_fit) }
    } else if shape.nameable {
        quote! {{
            #[allow(unused_imports)]
            use #krate::__private::judges::*;
            (&&#krate::__private::tag::<#ret>()).give_up(#none_fit)
        }}
    } else {
        quote! { #krate::__private::panic_no_executable_batch_size(#none_fit) }
    }
}
