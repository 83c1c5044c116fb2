//! The job token of the Id exchange: rank 0 and each rank prove to each other that they know it
//! without sending it, by an HMAC-SHA-256 over both sides' fresh nonces and the rank, and the Id
//! travels masked and tagged under the same key.
//!
//! Every message is bound to the rank and to both nonces, and each direction has its own label:
//! an answer recorded from one connection (or reflected back) is worth nothing on another.

use std::fmt;
use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::ID_BYTES;

/// The bytes of a nonce, of a proof and of the Id's tag.
pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) const PROOF_BYTES: usize = 32;

/// The Id masked, then its tag.
pub(crate) const SEALED_BYTES: usize = ID_BYTES + PROOF_BYTES;

type HmacSha256 = Hmac<Sha256>;

pub(crate) type Nonce = [u8; NONCE_BYTES];
pub(crate) type Proof = [u8; PROOF_BYTES];

// One label for each use of the key (16 bytes each, so no message can be read as another's).
const RANK_0_PROVES: &[u8; 16] = b"bsidx rank 0 pro";
const RANK_PROVES: &[u8; 16] = b"bsidx rank proof";
const ID_MASK: &[u8; 16] = b"bsidx id mask   ";
const ID_TAG: &[u8; 16] = b"bsidx id tag    ";

/// A secret that every rank of one job knows. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct JobToken(Vec<u8>);

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<hidden>)")
    }
}

impl JobToken {
    pub(crate) fn new(secret: impl AsRef<[u8]>) -> Self {
        JobToken(secret.as_ref().to_vec())
    }

    /// The key, ready to sign one connection's messages.
    pub(crate) fn keyed(&self) -> io::Result<Keyed> {
        // HMAC takes keys of any length (a long one is hashed): this fails on no token.
        HmacSha256::new_from_slice(&self.0)
            .map(Keyed)
            .map_err(|error| io::Error::other(format!("keying the HMAC: {error}")))
    }
}

/// The token as an HMAC key.
#[derive(Clone)]
pub(crate) struct Keyed(HmacSha256);

impl fmt::Debug for Keyed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Keyed(<hidden>)")
    }
}

/// One connection's context: the rank that asks and both nonces.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Session {
    pub(crate) rank: u32,
    pub(crate) rank_nonce: Nonce,
    pub(crate) rank_0_nonce: Nonce,
}

impl Keyed {
    fn mac(&self, label: &[u8; 16], session: &Session) -> HmacSha256 {
        let mut mac = self.0.clone();
        mac.update(label);
        mac.update(&session.rank.to_le_bytes());
        mac.update(&session.rank_nonce);
        mac.update(&session.rank_0_nonce);
        mac
    }

    /// What rank 0 sends to prove it knows the token.
    pub(crate) fn rank_0_proof(&self, session: &Session) -> Proof {
        self.proof(RANK_0_PROVES, session)
    }

    /// Whether `proof` is rank 0's for this session (in constant time).
    pub(crate) fn is_rank_0_proof(&self, session: &Session, proof: &[u8]) -> bool {
        self.mac(RANK_0_PROVES, session).verify_slice(proof).is_ok()
    }

    /// What a rank sends to prove it knows the token.
    pub(crate) fn rank_proof(&self, session: &Session) -> Proof {
        self.proof(RANK_PROVES, session)
    }

    /// Whether `proof` is the rank's for this session (in constant time).
    pub(crate) fn is_rank_proof(&self, session: &Session, proof: &[u8]) -> bool {
        self.mac(RANK_PROVES, session).verify_slice(proof).is_ok()
    }

    /// The proof of the side `who` for this session.
    fn proof(&self, who: &[u8; 16], session: &Session) -> Proof {
        self.mac(who, session).finalize().into_bytes().into()
    }

    /// The Id masked with a key stream only the two sides can compute (HMAC in counter mode,
    /// as HKDF expands), then a tag over the Id: a listener on the network learns nothing, and
    /// a change on the way is seen.
    pub(crate) fn seal(&self, session: &Session, id: &[u8; ID_BYTES]) -> [u8; SEALED_BYTES] {
        let mut sealed = [0u8; SEALED_BYTES];
        sealed[..ID_BYTES].copy_from_slice(id);
        self.mask(session, &mut sealed[..ID_BYTES]);
        let mut tag = self.mac(ID_TAG, session);
        tag.update(id);
        sealed[ID_BYTES..].copy_from_slice(&tag.finalize().into_bytes());
        sealed
    }

    /// The Id from [`seal`](Self::seal)'s bytes, or `None` when its tag does not match.
    pub(crate) fn open(
        &self,
        session: &Session,
        sealed: &[u8; SEALED_BYTES],
    ) -> Option<[u8; ID_BYTES]> {
        let mut id = [0u8; ID_BYTES];
        id.copy_from_slice(&sealed[..ID_BYTES]);
        self.mask(session, &mut id);
        let mut tag = self.mac(ID_TAG, session);
        tag.update(&id);
        tag.verify_slice(&sealed[ID_BYTES..]).ok()?;
        Some(id)
    }

    fn mask(&self, session: &Session, bytes: &mut [u8]) {
        for (block, chunk) in bytes.chunks_mut(PROOF_BYTES).enumerate() {
            let mut stream = self.mac(ID_MASK, session);
            stream.update(&(block as u32).to_le_bytes());
            for (byte, key) in chunk.iter_mut().zip(stream.finalize().into_bytes()) {
                *byte ^= key;
            }
        }
    }
}

/// A fresh nonce from the operating system's random numbers.
pub(crate) fn nonce() -> io::Result<Nonce> {
    let mut nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|error| {
        io::Error::other(format!(
            "the operating system gave no random numbers for a nonce: {error}"
        ))
    })?;
    Ok(nonce)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn session(rank: u32) -> Session {
        Session {
            rank,
            rank_nonce: nonce().unwrap(),
            rank_0_nonce: nonce().unwrap(),
        }
    }

    #[test]
    fn proofs_hold_for_their_own_session_and_direction_only() {
        let key = JobToken::new("job 1").keyed().unwrap();
        let other_key = JobToken::new("job 2").keyed().unwrap();
        let here = session(1);
        let proof = key.rank_proof(&here);
        assert!(key.is_rank_proof(&here, &proof));
        assert!(!other_key.is_rank_proof(&here, &proof), "another token");
        assert!(!key.is_rank_0_proof(&here, &proof), "reflected");
        assert!(!key.is_rank_proof(&session(1), &proof), "replayed");
        let mut other_rank = here;
        other_rank.rank = 2;
        assert!(!key.is_rank_proof(&other_rank, &proof), "another rank");
        assert!(key.is_rank_0_proof(&here, &key.rank_0_proof(&here)));
    }

    #[test]
    fn the_sealed_id_hides_it_and_opens_only_unchanged() {
        let key = JobToken::new("job").keyed().unwrap();
        let here = session(3);
        let id = [7u8; ID_BYTES];
        let sealed = key.seal(&here, &id);
        assert_ne!(&sealed[..ID_BYTES], &id[..]);
        assert_eq!(key.open(&here, &sealed), Some(id));
        let mut changed = sealed;
        changed[5] ^= 1;
        assert_eq!(key.open(&here, &changed), None);
        assert_eq!(key.open(&session(3), &sealed), None);
        assert_eq!(
            JobToken::new("other").keyed().unwrap().open(&here, &sealed),
            None
        );
    }

    #[test]
    fn debug_hides_the_token() {
        assert_eq!(
            format!("{:?}", JobToken::new("secret")),
            "JobToken(<hidden>)"
        );
    }
}
