//! The store's errors: what callers branch on (a missing or existing key, a full pool, a corrupt
//! spill file), with the engine's [`tensorwire_core::Error`] wrapped where a transfer, registered
//! memory or the network underneath is the cause. Encoded for the store RPC by a total codec.

use std::fmt;
use std::sync::Arc;

use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_proto::wire::error::{MAX_ERROR_BYTES, MAX_ERROR_TEXT, decode_error, encode_error};

/// Result with [`StoreError`].
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Longest key in bytes (defined beside the key type errors carry, so that the API above and
/// the error codec below read one bound).
pub const MAX_KEY: usize = 256;

/// A store key as it appears in errors (printable when UTF-8, hex otherwise).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct StoreKey(pub Vec<u8>);

impl fmt::Display for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) => write!(f, "{s:?}"),
            Err(_) => {
                f.write_str("0x")?;
                self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Every error a [`crate::Store`] reports.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The key is not stored: never put, removed, consumed, expired, or evicted without a spill tier.
    #[error("store key {key} not found (never stored, removed, consumed, expired or evicted)")]
    NotFound {
        /// The key.
        key: StoreKey,
    },
    /// A put of a key that is stored (or being put) already.
    #[error("store key {key} already exists (remove it first)")]
    Exists {
        /// The key.
        key: StoreKey,
    },
    /// An argument that can never be valid: a key of the wrong length, an unpin of an unpinned
    /// key, a consumer report for a key without a consumer count, bad watermarks.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The object's metadata does not fit its bytes (or the reference it was fetched for).
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// The pool cannot hold the object, even after evicting everything evictable.
    #[error("capacity: {what}: requested {requested}, limit {limit}")]
    Capacity {
        /// What is full.
        what: String,
        /// Bytes asked for.
        requested: u64,
        /// The bound.
        limit: u64,
    },
    /// A spill file is truncated, has a bad header or fails its checksum: never served.
    #[error("corrupt spill file: {0}")]
    Corrupt(String),
    /// A file of the spill tier could not be read or written.
    #[error("spill tier: {what}: {source}")]
    Io {
        /// The file and operation.
        what: String,
        /// The OS error.
        source: Arc<std::io::Error>,
    },
    /// The engine underneath failed: a transfer, registered memory (a region too small, device
    /// memory without a copier), or the connection to a store node.
    #[error(transparent)]
    Engine(#[from] tensorwire_core::Error),
    /// An invariant of the store broke (a bug, please report it).
    #[error("store internal error (a tensorwire bug; please report it): {0}")]
    Internal(String),
}

impl StoreError {
    /// The error for a key that is not stored.
    pub fn not_found(key: &[u8]) -> StoreError {
        StoreError::NotFound { key: StoreKey(key.to_vec()) }
    }
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(MAX_ERROR_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Longest key an encoded error carries.
const MAX_KEY_IN_ERROR: usize = MAX_KEY;

/// Encodes a store error for the RPC (bounded by [`MAX_STORE_ERROR_BYTES`]).
pub(crate) fn encode(e: &StoreError) -> Vec<u8> {
    let mut w = Writer::new();
    match e {
        StoreError::NotFound { key } => w.u8(1).bytes(&key.0[..key.0.len().min(MAX_KEY_IN_ERROR)]),
        StoreError::Exists { key } => w.u8(2).bytes(&key.0[..key.0.len().min(MAX_KEY_IN_ERROR)]),
        StoreError::InvalidArgument(s) => w.u8(3).str(clip(s)),
        StoreError::InvalidTensor(s) => w.u8(4).str(clip(s)),
        StoreError::Capacity { what, requested, limit } => {
            w.u8(5).str(clip(what)).u64(*requested).u64(*limit)
        }
        StoreError::Corrupt(s) => w.u8(6).str(clip(s)),
        StoreError::Io { what, source } => w.u8(7).str(clip(what)).str(clip(&source.to_string())),
        StoreError::Engine(e) => w.u8(8).bytes(&encode_error(e)),
        StoreError::Internal(s) => w.u8(9).str(clip(s)),
    };
    w.finish()
}

/// Upper bound of an encoded store error.
pub(crate) const MAX_STORE_ERROR_BYTES: usize = MAX_ERROR_BYTES + 2 * MAX_ERROR_TEXT + 64;

/// Decodes what `encode` wrote; never panics.
pub(crate) fn decode(buf: &[u8]) -> tensorwire_core::Result<StoreError> {
    let mut r = Reader::new(buf, "store error");
    let text = |r: &mut Reader<'_>, f: &str| r.str(MAX_ERROR_TEXT, f);
    let key = |r: &mut Reader<'_>| r.bytes(MAX_KEY_IN_ERROR, "key").map(|k| StoreKey(k.to_vec()));
    let e = match r.u8()? {
        1 => StoreError::NotFound { key: key(&mut r)? },
        2 => StoreError::Exists { key: key(&mut r)? },
        3 => StoreError::InvalidArgument(text(&mut r, "reason")?),
        4 => StoreError::InvalidTensor(text(&mut r, "reason")?),
        5 => StoreError::Capacity {
            what: text(&mut r, "what")?,
            requested: r.u64()?,
            limit: r.u64()?,
        },
        6 => StoreError::Corrupt(text(&mut r, "reason")?),
        7 => {
            let what = text(&mut r, "what")?;
            let source = Arc::new(std::io::Error::other(text(&mut r, "cause")?));
            StoreError::Io { what, source }
        }
        8 => StoreError::Engine(decode_error(r.bytes(MAX_ERROR_BYTES, "engine error")?)?),
        9 => StoreError::Internal(text(&mut r, "reason")?),
        t => {
            return Err(tensorwire_core::Error::protocol(format!("store error: unknown tag {t}")));
        }
    };
    r.finish()?;
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn variants_survive_the_wire() {
        let all = [
            StoreError::not_found(b"k1"),
            StoreError::Exists { key: StoreKey(vec![0xff, 0]) },
            StoreError::InvalidArgument("x".into()),
            StoreError::InvalidTensor("y".into()),
            StoreError::Capacity { what: "pool".into(), requested: 9, limit: 8 },
            StoreError::Corrupt("truncated".into()),
            StoreError::Io { what: "w".into(), source: Arc::new(std::io::Error::other("disk")) },
            StoreError::Engine(tensorwire_core::Error::PeerClosed("gone".into())),
            StoreError::Internal("bug".into()),
        ];
        for e in all {
            let b = encode(&e);
            assert!(b.len() <= MAX_STORE_ERROR_BYTES);
            assert_eq!(decode(&b).unwrap().to_string(), e.to_string());
        }
        assert_eq!(StoreError::not_found(&[0xff, 2]).to_string().split(' ').nth(2), Some("0xff02"));
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }
    }
}
