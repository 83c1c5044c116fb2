//! The `#[find_executable_batch_size]` attribute. Use it through `batch-size-runtime`, which
//! re-exports it and documents it; this crate only rewrites the function.

#![warn(missing_docs)]

mod args;
mod expand;
mod signature;
mod spans;

use proc_macro::TokenStream;

/// Rewrites a function whose first parameter is the batch size into one without that parameter
/// that retries the body with smaller sizes on out-of-memory. See
/// `batch_size_runtime::find_executable_batch_size` for the documentation.
#[proc_macro_attribute]
pub fn find_executable_batch_size(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::find_executable_batch_size(args.into(), item.into()).into()
}
