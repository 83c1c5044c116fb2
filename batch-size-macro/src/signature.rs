//! Reading the function's signature: which parameter is the batch size, how every other
//! parameter is handed to each attempt, and what the return type allows.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, ToTokens};
use std::collections::HashSet;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;

use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{FnArg, Ident, Pat, PatIdent, PatType, ReturnType, Signature, Token, Type};

/// The batch-size parameter, removed from the signature.
pub(crate) struct BatchSizeParam {
    pub(crate) pat: Pat,
    pub(crate) ty: Type,
    /// Written `BatchPlan`: each attempt gets a plan of micro-batches (`effective = ...`).
    pub(crate) is_plan: bool,
    /// Written `Remedied<...>`: each attempt gets its size and settings (`remedies = ...`).
    pub(crate) is_remedied: bool,
}

/// Whether `ty` names `Remedied<...>` (by its last segment).
pub(crate) fn is_remedied(ty: &Type) -> bool {
    match ty {
        Type::Path(path) if path.qself.is_none() => path
            .path
            .segments
            .last()
            .is_some_and(|last| last.ident == "Remedied"),
        Type::Paren(inner) => is_remedied(&inner.elem),
        Type::Group(inner) => is_remedied(&inner.elem),
        _ => false,
    }
}

/// Whether `ty` names `BatchPlan` (by its last segment, as `batch_size_runtime::BatchPlan` or
/// imported).
pub(crate) fn is_batch_plan(ty: &Type) -> bool {
    match ty {
        Type::Path(path) if path.qself.is_none() => path
            .path
            .segments
            .last()
            .is_some_and(|last| last.ident == "BatchPlan" && last.arguments.is_none()),
        Type::Paren(inner) => is_batch_plan(&inner.elem),
        Type::Group(inner) => is_batch_plan(&inner.elem),
        _ => false,
    }
}

/// The signature split for the rewrite.
pub(crate) struct Split {
    /// The signature without the batch-size parameter, patterns made plain where needed.
    pub(crate) outer: Signature,
    pub(crate) batch_size: BatchSizeParam,
    /// `let` statements that give one attempt its own copy or reborrow of each parameter.
    pub(crate) rebind: Vec<Rebinding>,
    /// What is wrong with a signature that could still be split (a `const fn`, `self` by value,
    /// a batch size that is not an integer): reported beside a placeholder with the rewritten
    /// signature, so that callers, which already omit the batch size, raise no errors of
    /// their own.
    pub(crate) error: Option<syn::Error>,
}

/// Adds `error` to those already found.
pub(crate) fn combine(errors: &mut Option<syn::Error>, error: syn::Error) {
    match errors {
        Some(errors) => errors.combine(error),
        None => *errors = Some(error),
    }
}

/// Splits `sig`, or explains why it has no batch size to take out.
pub(crate) fn split(
    sig: &Signature,
    private: &syn::Path,
    used_by_args: &HashSet<String>,
) -> syn::Result<Split> {
    let mut error = None;
    if let Some(constness) = &sig.constness {
        combine(
            &mut error,
            syn::Error::new(
                constness.span(),
                "#[find_executable_batch_size] cannot rewrite a `const fn`: retrying on out-of-memory happens at run time",
            ),
        );
    }
    let mut inputs = sig.inputs.iter();
    let mut outer_inputs: Punctuated<FnArg, Token![,]> = Punctuated::new();

    let mut first = inputs.next();
    if let Some(FnArg::Receiver(receiver)) = first {
        let by_reference =
            receiver.reference.is_some() || matches!(&*receiver.ty, Type::Reference(_));
        if !by_reference {
            combine(
                &mut error,
                syn::Error::new(
                    receiver.self_token.span(),
                    "#[find_executable_batch_size] cannot give `self` by value to several attempts: take `&self` or `&mut self` (or clone what you need into a parameter)",
                ),
            );
        }
        outer_inputs.push(FnArg::Receiver(receiver.clone()));
        first = inputs.next();
    }

    // A batch size written later (`fn train(data: &Data, batch_size: usize)`): one error that
    // says to move it first, and the signature without it, so that callers raise none.
    let rest: Vec<&FnArg> = inputs.collect();
    let misplaced = match first {
        Some(FnArg::Typed(first)) if check_batch_size_type(&first.ty).is_err() => {
            rest.iter().position(|input| is_misplaced_batch_size(input))
        }
        _ => None,
    };
    let rest: Vec<&FnArg> = match (misplaced, first) {
        (Some(index), Some(first_param)) => {
            let param = rest[index];
            combine(
                &mut error,
                syn::Error::new_spanned(
                    param,
                    format!(
                        "the batch size must be the first parameter{} of `{}`: move `{}` first",
                        if sig.receiver().is_some() {
                            " after the receiver"
                        } else {
                            ""
                        },
                        sig.ident,
                        param.to_token_stream()
                    ),
                ),
            );
            let mut others = vec![first_param];
            others.extend(
                rest.iter()
                    .enumerate()
                    .filter(|(i, _)| *i != index)
                    .map(|(_, input)| *input),
            );
            first = Some(rest[index]);
            others
        }
        _ => rest,
    };

    let batch_size = match first {
        Some(FnArg::Typed(PatType { pat, ty, .. })) => {
            if misplaced.is_none() {
                if let Err(wrong_type) = check_batch_size_type(ty) {
                    if contains_impl_trait(ty) {
                        // Not even a placeholder can name this type.
                        return Err(wrong_type);
                    }
                    combine(&mut error, wrong_type);
                }
            }
            BatchSizeParam {
                pat: (**pat).clone(),
                ty: (**ty).clone(),
                is_plan: is_batch_plan(ty),
                is_remedied: is_remedied(ty),
            }
        }
        _ => {
            return Err(syn::Error::new(
                sig.paren_token.span.join(),
                format!(
                    "`{}` needs the batch size as its first parameter{}, e.g. `fn {}(batch_size: usize, ...)`",
                    sig.ident,
                    if sig.receiver().is_some() { " after the receiver" } else { "" },
                    sig.ident
                ),
            ))
        }
    };

    let mut rebind = Vec::new();
    for (index, input) in rest.into_iter().enumerate() {
        let FnArg::Typed(param) = input else {
            continue;
        };
        let (outer_pat, name) = outer_pattern(&param.pat, index);
        let used_by_attribute = used_by_args.contains(&name.to_string());
        rebind.push(rebinding(param, &name, private, used_by_attribute));
        let mut outer_param = param.clone();
        outer_param.pat = Box::new(outer_pat);
        outer_inputs.push(FnArg::Typed(outer_param));
    }

    let mut outer = sig.clone();
    outer.inputs = outer_inputs;
    // Reported above: the placeholder is an ordinary function.
    outer.constness = None;
    Ok(Split {
        outer,
        batch_size,
        rebind,
        error,
    })
}

fn contains_impl_trait(ty: &Type) -> bool {
    let mut finder = ImplTraitFinder(false);
    finder.visit_type(ty);
    finder.0
}

const INTEGERS: [&str; 12] = [
    "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize",
];

/// A later parameter that is plainly the batch size: a primitive integer whose name says so.
fn is_misplaced_batch_size(input: &FnArg) -> bool {
    let FnArg::Typed(PatType { pat, ty, .. }) = input else {
        return false;
    };
    let Pat::Ident(PatIdent { ident, .. }) = &**pat else {
        return false;
    };
    let Type::Path(path) = &**ty else {
        return false;
    };
    let integer = path
        .path
        .get_ident()
        .is_some_and(|name| INTEGERS.contains(&name.to_string().as_str()));
    integer && ident.to_string().contains("batch")
}

/// Rejects types that are plainly not integers; aliases are checked by a trait bound later.
fn check_batch_size_type(ty: &Type) -> syn::Result<()> {
    let reject = |what: &str| {
        Err(syn::Error::new_spanned(
            ty,
            format!(
                "the first parameter is the batch size and must be a primitive integer type (`usize`, `u32`, `i64`, ...), not {what}"
            ),
        ))
    };
    match ty {
        Type::Path(path) if path.qself.is_none() => {
            let Some(last) = path.path.segments.last() else {
                return Ok(());
            };
            let name = last.ident.to_string();
            if INTEGERS.contains(&name.as_str()) {
                return Ok(());
            }
            match name.as_str() {
                "f32" | "f64" | "bool" | "char" | "str" | "String" | "Vec" | "Option" => {
                    reject(&format!("`{}`", ty.to_token_stream()))
                }
                _ => Ok(()),
            }
        }
        Type::Reference(_) => reject("a reference"),
        Type::Tuple(_) => reject("a tuple"),
        Type::Array(_) | Type::Slice(_) => reject("an array or slice"),
        Type::Ptr(_) => reject("a pointer"),
        Type::BareFn(_) => reject("a function pointer"),
        Type::ImplTrait(_) | Type::TraitObject(_) => reject("a trait type"),
        Type::Paren(inner) => check_batch_size_type(&inner.elem),
        Type::Group(inner) => check_batch_size_type(&inner.elem),
        _ => Ok(()),
    }
}

/// The pattern the outer function binds: the user's identifier (without `mut`, which belongs
/// to each attempt's copy), or a fresh name for `_` and destructuring patterns.
fn outer_pattern(pat: &Pat, index: usize) -> (Pat, Ident) {
    if let Pat::Ident(PatIdent {
        attrs,
        ident,
        subpat: None,
        ..
    }) = pat
    {
        let plain = Pat::Ident(PatIdent {
            attrs: attrs.clone(),
            by_ref: None,
            mutability: None,
            ident: ident.clone(),
            subpat: None,
        });
        return (plain, ident.clone());
    }
    let name = format_ident!("__batch_size_arg{}", index, span = pat.span());
    let plain = Pat::Ident(PatIdent {
        attrs: Vec::new(),
        by_ref: None,
        mutability: None,
        ident: name.clone(),
        subpat: None,
    });
    (plain, name)
}

/// How one parameter reaches each attempt.
pub(crate) struct Rebinding {
    /// For a synchronous attempt (and an async closure): shared references copied, mutable
    /// ones reborrowed, owned values cloned.
    pub(crate) sync: TokenStream,
    /// For an `async fn` whose attempt is a closure returning an `async move` block, so that
    /// the future stays `Send` when the body is: before the search (a `&mut` parameter is
    /// put where each attempt can borrow it in turn), in the closure, and in the block.
    pub(crate) before: TokenStream,
    pub(crate) in_closure: TokenStream,
    pub(crate) in_future: TokenStream,
}

/// One attempt's binding of a parameter: shared references are copied, mutable ones
/// reborrowed, owned values cloned (a compile error names a parameter that is not `Clone`).
///
/// The binding carries the user's pattern, so a parameter the body never uses still gets
/// rustc's unused-variable warning at the parameter; one that the attribute's arguments use
/// (`starting = cfg.batch_size`) is used, and its copy is allowed to go unused.
fn rebinding(
    param: &PatType,
    name: &Ident,
    private: &syn::Path,
    used_by_attribute: bool,
) -> Rebinding {
    let PatType { pat, ty, .. } = param;
    let none = TokenStream::new;
    if let Pat::Wild(_) = &**pat {
        return Rebinding {
            sync: none(),
            before: none(),
            in_closure: none(),
            in_future: none(),
        };
    }
    let allow = used_by_attribute.then(|| quote! { #[allow(unused_variables)] });
    match &**ty {
        Type::Reference(reference) if reference.mutability.is_some() => {
            let guard =
                quote::format_ident!("__batch_size_lent_{}", name, span = Span::mixed_site());
            Rebinding {
                sync: quote! { #allow let #pat = &mut *#name; },
                before: quote! { let #name = #private::Lend::new(#name); let #name = &#name; },
                in_closure: TokenStream::new(),
                in_future: quote! { let mut #guard = #name.lend(); #allow let #pat = &mut *#guard; },
            }
        }
        Type::Reference(_) => {
            let copy = quote! { #allow let #pat = #name; };
            // A shared reference named as the parameter is already what each attempt needs:
            // the synchronous closure uses it as it is (its copy would be one more line).
            let as_is = matches!(&**pat, Pat::Ident(ident)
                if ident.ident == *name && ident.by_ref.is_none() && ident.mutability.is_none()
                    && ident.subpat.is_none());
            Rebinding {
                sync: if as_is { none() } else { copy.clone() },
                before: none(),
                in_closure: copy,
                in_future: none(),
            }
        }
        _ => {
            // Laid over the parameter: one whose type is not `Clone` is reported there.
            let clone = crate::spans::call_over(
                quote! { #private::ClonePerAttempt::clone_for_attempt },
                crate::spans::over(quote! { &#name }, param),
                param,
            );
            let clone = quote! { #allow let #pat = #clone; };
            Rebinding {
                sync: clone.clone(),
                before: none(),
                in_closure: clone,
                in_future: none(),
            }
        }
    }
}

/// What the return type allows the generated code to do.
pub(crate) struct ReturnShape {
    /// The type as written (`()` when there is none).
    pub(crate) ty: Type,
    /// The type with `_` for each `impl Trait` in it, for the driver and the dispatch ladders;
    /// `None` when the whole type is an `impl Trait`.
    pub(crate) inferable: Option<Type>,
}

pub(crate) fn return_shape(output: &ReturnType) -> ReturnShape {
    match output {
        ReturnType::Default => ReturnShape {
            ty: syn::parse_quote!(()),
            inferable: Some(syn::parse_quote!(())),
        },
        ReturnType::Type(_, ty) => {
            let inferable = match &**ty {
                Type::ImplTrait(_) => None,
                _ => {
                    let mut inferable = (**ty).clone();
                    ImplTraitToInfer.visit_type_mut(&mut inferable);
                    Some(inferable)
                }
            };
            ReturnShape {
                ty: (**ty).clone(),
                inferable,
            }
        }
    }
}

struct ImplTraitFinder(bool);

impl<'ast> Visit<'ast> for ImplTraitFinder {
    fn visit_type_impl_trait(&mut self, _: &'ast syn::TypeImplTrait) {
        self.0 = true;
    }
}

/// Replaces each `impl Trait` with `_`, which inference fills from the body.
struct ImplTraitToInfer;

impl syn::visit_mut::VisitMut for ImplTraitToInfer {
    fn visit_type_mut(&mut self, ty: &mut Type) {
        if let Type::ImplTrait(impl_trait) = ty {
            *ty = Type::Infer(syn::TypeInfer {
                underscore_token: Token![_](impl_trait.impl_token.span),
            });
            return;
        }
        syn::visit_mut::visit_type_mut(self, ty);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use quote::ToTokens;

    use super::*;

    fn shape(text: &str) -> ReturnShape {
        let sig: Signature = syn::parse_str(text).unwrap();
        return_shape(&sig.output)
    }

    #[test]
    fn impl_trait_in_the_return_type_is_left_to_inference() {
        let inferable = shape("fn f() -> Result<impl Display, anyhow::Error>").inferable;
        assert_eq!(
            inferable.unwrap().to_token_stream().to_string(),
            "Result < _ , anyhow :: Error >"
        );
        assert!(shape("fn f() -> impl Display").inferable.is_none());
        assert_eq!(
            shape("fn f()")
                .inferable
                .unwrap()
                .to_token_stream()
                .to_string(),
            "()"
        );
    }

    #[test]
    fn the_batch_size_parameter_is_taken_out() {
        let sig: Signature =
            syn::parse_str("fn train(&self, batch_size: u32, data: &[u8], n: usize) -> usize")
                .unwrap();
        let private: syn::Path = syn::parse_str("::rt::__private").unwrap();
        let split = split(&sig, &private, &HashSet::new()).unwrap();
        assert_eq!(
            split.outer.to_token_stream().to_string(),
            "fn train (& self , data : & [u8] , n : usize) -> usize"
        );
        assert_eq!(split.rebind.len(), 2);
        assert!(split.error.is_none());
    }
}
