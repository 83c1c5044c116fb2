//! Several ranks (processes or threads, one GPU each) agreeing on one batch size, so that no
//! rank retries alone while the others wait in a collective that never completes.
//!
//! [`Agree`] wraps any [`SizePolicy`](crate::policy::SizePolicy): at the end of every attempt
//! each rank contributes whether it succeeded, ran out of memory or failed otherwise, and what
//! its own policy proposes; an all-reduce (MAX of the outcomes, MIN of the proposals, as
//! Composer does) gives every rank the same verdict. If any rank ran out of memory, every rank
//! retries at the same size, the smallest proposal; if one failed with an error that is not
//! out-of-memory, the others stop with an error naming it; if all succeeded, all accept.
//!
//! The collective is a small trait, [`Collective`]; [`ThreadRanks`] implements it for threads
//! of one process (tests, one process driving several GPUs); with the `nccl` feature, `NcclRank`
//! over NCCL; with the `mpi` feature, `MpiRank` over the MPI of a job launched with `mpirun` or
//! `srun` (see `MpiJob`).
//!
//! The ranks of an `NcclRank` share rank 0's NCCL Id (128 bytes) one of three ways: MPI's
//! broadcast (`MpiJob`, with both features, under `mpirun` or `srun`); a file every rank can read
//! (`IdExchange::file`, one machine or a shared filesystem); or any channel the program already
//! has (a torchrun-style launcher's store, say), with `NcclId::as_bytes` on rank 0 and
//! `NcclId::from_bytes` on the others.
//!
//! ```
//! use std::thread;
//! use batch_size_runtime::agree::{Agree, ThreadRanks};
//! use batch_size_runtime::policy::Halve;
//! use batch_size_runtime::{BatchSizeSearch, OutOfMemory};
//!
//! // Two GPUs: the first holds 100 samples, the second 40.
//! let handles: Vec<_> = ThreadRanks::new(2)
//!     .into_iter()
//!     .zip([100usize, 40])
//!     .map(|(rank, fits)| {
//!         thread::spawn(move || {
//!             BatchSizeSearch::new(128)
//!                 .with_policy(Agree::new(Halve, rank))
//!                 .run(|size| -> anyhow::Result<usize> {
//!                     if size > fits { Err(OutOfMemory::new())? }
//!                     Ok(size)
//!                 })
//!                 .unwrap()
//!         })
//!     })
//!     .collect();
//! let sizes: Vec<usize> = handles.into_iter().map(|handle| handle.join().unwrap()).collect();
//! assert_eq!(sizes, [32, 32]); // both at the size the smaller GPU holds
//! ```
//!
//! # Where a rank may run out of memory
//! The agreement happens between attempts. Inside an attempt, a rank that runs out of memory
//! must not be left alone while the others enter a collective of the training step (the
//! gradient all-reduce): they would wait forever. Call [`safe_point()`] after the forward and
//! backward passes and before the gradient all-reduce:
//!
//! ```text
//! rank 0: forward ─ backward ─ safe_point ─┬─ all-reduce gradients ─ optimizer step
//! rank 1: forward ─ OOM ──────── safe_point ┘  (every rank leaves with "OOM on another rank")
//! ```

// One concept a file: the trait, the in-process ranks, the policy wrapper, one round of the
// protocol, the safe point inside an attempt; the Id's file exchange and NCCL above.
mod collective;
mod policy;
mod safe_point;
mod threads;
mod verdict;

// The Id's file exchange and NCCL: built only with the `nccl` feature.
#[cfg(feature = "nccl")]
mod exchange;
#[cfg(feature = "nccl")]
mod nccl;

// The agreement over the job's own MPI (`mpirun`, `srun`): its own feature, since it needs an MPI
// library to build.
#[cfg(feature = "mpi")]
mod mpi;

#[cfg(feature = "mpi")]
#[cfg_attr(docsrs, doc(cfg(feature = "mpi")))]
pub use self::mpi::{MpiError, MpiJob, MpiRank};
pub use collective::{AgreementError, Collective, ReduceOp};
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub use exchange::{ExchangeError, IdExchange, ID_BYTES};
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub use nccl::{loaded_library, NcclError, NcclId, NcclRank, NCCL_LIBRARY_VARIABLE};
pub use policy::Agree;
pub use safe_point::{safe_point, OutOfMemoryOnAnotherRank};
pub use threads::{ThreadRank, ThreadRanks};

// `Chunked` agrees without the `Agree` wrapper: it speaks the protocol directly.
pub(crate) use verdict::{
    agreed_start, disagreement, round, tell_failure, Proposal, RankOutcome, Said,
};
