//! Laying generated expressions over the user's tokens, so that a failed trait bound is
//! reported under the parameter or return type it concerns, not under the whole attribute.

use proc_macro2::{Delimiter, Group, Span, TokenStream, TokenTree};
use quote::ToTokens;

/// The spans of the first and last tokens of `target`.
fn bounds(target: &impl ToTokens) -> Option<(Span, Span)> {
    let mut tokens = target.to_token_stream().into_iter();
    let first = tokens.next()?.span();
    let last = tokens.last().map_or(first, |token| token.span());
    Some((first, last))
}

/// `expr` laid over the source of `target`: its first token at the target's first token, its
/// last at the target's last, everything between at the first.
///
/// Every token keeps its own name resolution (so `::batch_size_runtime`, a user's
/// `crate = rt` and the generated locals resolve as before), except that the last token
/// borrows the first's: rustc joins the two ends of an expression's span only when they come
/// from the same context.
pub(crate) fn over(expr: TokenStream, target: &impl ToTokens) -> TokenStream {
    let Some((first, last)) = bounds(target) else {
        return expr;
    };
    let mut tokens: Vec<TokenTree> = expr.into_iter().collect();
    let anchor = tokens.first().map_or_else(Span::call_site, TokenTree::span);
    let count = tokens.len();
    for (index, token) in tokens.iter_mut().enumerate() {
        if index + 1 == count && count > 1 {
            set_span(token, last.resolved_at(anchor), last);
        } else {
            let span = token.span().located_at(first);
            set_span(token, span, first);
        }
    }
    tokens.into_iter().collect()
}

/// `path(args)` laid over `target` (see [`over`]): the path, and the call, span the target.
pub(crate) fn call_over(
    path: TokenStream,
    args: TokenStream,
    target: &impl ToTokens,
) -> TokenStream {
    let mut call = over(path, target);
    let mut parenthesized = Group::new(Delimiter::Parenthesis, args);
    if let (Some((_, last)), Some(anchor)) = (bounds(target), call.clone().into_iter().next()) {
        parenthesized.set_span(last.resolved_at(anchor.span()));
    }
    call.extend([TokenTree::Group(parenthesized)]);
    call
}

/// Moves `token` to `span`, and the tokens inside a group to `location` with their own
/// resolution.
fn set_span(token: &mut TokenTree, span: Span, location: Span) {
    if let TokenTree::Group(group) = token {
        let inner = group
            .stream()
            .into_iter()
            .map(|mut inner| {
                let inner_span = inner.span().located_at(location);
                set_span(&mut inner, inner_span, location);
                inner
            })
            .collect();
        let mut moved = Group::new(group.delimiter(), inner);
        moved.set_span(span);
        *group = moved;
    } else {
        token.set_span(span);
    }
}
