//! The last out-of-memory error of a search, kept for `NoExecutableBatchSize`'s `source()`.
//!
//! Below the errors: `error.rs` holds a `KeptError`, and nothing here needs to know the error
//! that holds it (hence no link to it, which would be an import back).

use std::error::Error;

/// The last out-of-memory error of a search, kept for `NoExecutableBatchSize`'s `source()`.
///
/// An `anyhow::Error` is kept as it is: turned into a `Box<dyn Error>` it would become anyhow's
/// own wrapper type, and `source().downcast_ref::<YourError>()` would no longer find the error
/// the attempt returned.
#[derive(Debug)]
pub struct KeptError(Kept);

#[derive(Debug)]
enum Kept {
    Boxed(Box<dyn Error + Send + Sync + 'static>),
    #[cfg(feature = "anyhow")]
    Anyhow(anyhow::Error),
}

impl KeptError {
    /// Keeps an error that converts into a box, unwrapping `anyhow::Error` as said above.
    pub(crate) fn keep<E>(error: E) -> Self
    where
        E: Into<Box<dyn Error + Send + Sync + 'static>> + 'static,
    {
        #[cfg(feature = "anyhow")]
        {
            let mut slot = Some(error);
            let any: &mut dyn std::any::Any = &mut slot;
            if let Some(anyhow_error) = any
                .downcast_mut::<Option<anyhow::Error>>()
                .and_then(Option::take)
            {
                return KeptError(Kept::Anyhow(anyhow_error));
            }
            match slot {
                Some(error) => KeptError(Kept::Boxed(error.into())),
                // Only taken above, where it was an anyhow::Error and returned.
                None => KeptError(Kept::Boxed("the out-of-memory error".into())),
            }
        }
        #[cfg(not(feature = "anyhow"))]
        {
            KeptError(Kept::Boxed(error.into()))
        }
    }

    pub(crate) fn as_error(&self) -> &(dyn Error + 'static) {
        match &self.0 {
            Kept::Boxed(error) => &**error,
            // anyhow's `Deref` gives the error it was built from, downcastable to its type.
            #[cfg(feature = "anyhow")]
            Kept::Anyhow(error) => {
                let error: &(dyn Error + Send + Sync + 'static) = error.as_ref();
                error
            }
        }
    }
}

impl From<Box<dyn Error + Send + Sync + 'static>> for KeptError {
    fn from(error: Box<dyn Error + Send + Sync + 'static>) -> Self {
        KeptError(Kept::Boxed(error))
    }
}
