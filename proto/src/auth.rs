//! Cluster-secret authentication for the handshake every framed protocol opens with: HMAC-SHA256
//! over both sides' nonces and the protocol's magic, with a different label per direction, so each
//! side proves it knows the secret without revealing it, and a recorded answer cannot be replayed
//! (fresh nonces), reflected (labels) or carried to another protocol (magic).
//!
//! Also here: secret files ([`ClusterSecret::from_file`], [`ClusterSecret::create_file`]) and the
//! rule every listener applies at start ([`check_listener`]: one other hosts can reach needs a
//! secret or an explicit `insecure` opt-out).

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub use crate::exposure::{check_listener, is_exposed};
pub use crate::secret_file::MIN_SECRET_BYTES;

/// Length of handshake nonces and MACs.
pub const AUTH_LEN: usize = 32;

const SERVER_LABEL: &[u8] = b"tensorwire/v2 server proof";
const CLIENT_LABEL: &[u8] = b"tensorwire/v2 client proof";

/// Which side a proof speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The side that accepted the connection.
    Server,
    /// The side that opened it.
    Client,
}

/// What a proof covers: the protocol's magic and both sides' nonces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    /// The framed protocol's magic.
    pub magic: [u8; 2],
    /// The client's nonce.
    pub client: [u8; AUTH_LEN],
    /// The server's nonce.
    pub server: [u8; AUTH_LEN],
}

/// A secret shared by every member of a cluster. Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<[u8]>);

impl ClusterSecret {
    /// A secret from bytes, unchecked (tests and tools; a secret from a user goes through
    /// [`ClusterSecret::from_bytes`] or [`ClusterSecret::from_file`], which refuse a short or
    /// regular one). An empty secret proves nothing and verifies nothing.
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        ClusterSecret(Arc::from(bytes.as_ref()))
    }

    /// A secret from bytes a user gave: at least [`MIN_SECRET_BYTES`] of them, not a few byte
    /// values repeated.
    pub fn from_bytes(bytes: impl AsRef<[u8]>) -> crate::Result<Self> {
        crate::secret_file::check_strength(bytes.as_ref())
            .map_err(|why| crate::Error::InvalidArgument(format!("cluster secret: {why}")))?;
        Ok(ClusterSecret::new(bytes))
    }

    fn mac(&self, side: Side, t: &Transcript) -> Hmac<Sha256> {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(match side {
            Side::Server => SERVER_LABEL,
            Side::Client => CLIENT_LABEL,
        });
        m.update(&t.magic);
        m.update(&t.client);
        m.update(&t.server);
        m
    }

    /// `side`'s proof for a handshake with transcript `t` (all zeros for an empty secret,
    /// which no verification accepts).
    pub fn proof(&self, side: Side, t: &Transcript) -> [u8; AUTH_LEN] {
        if self.0.is_empty() {
            return [0; AUTH_LEN];
        }
        self.mac(side, t).finalize().into_bytes().into()
    }

    /// Checks `side`'s proof in constant time; an empty secret verifies nothing.
    pub fn verify(&self, side: Side, t: &Transcript, proof: &[u8]) -> bool {
        !self.0.is_empty() && self.mac(side, t).verify_slice(proof).is_ok()
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// A fresh random nonce.
pub fn nonce() -> [u8; AUTH_LEN] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_nonces_side_and_protocol() {
        let s = ClusterSecret::new(b"cluster secret");
        let t = Transcript { magic: *b"TW", client: nonce(), server: nonce() };
        let sp = s.proof(Side::Server, &t);
        assert!(s.verify(Side::Server, &t, &sp));
        assert!(!ClusterSecret::new(b"other").verify(Side::Server, &t, &sp));
        let swapped = Transcript { client: t.server, server: t.client, ..t };
        assert!(!s.verify(Side::Server, &swapped, &sp), "swapped nonces");
        assert!(!s.verify(Side::Client, &t, &sp), "a server proof reflected");
        let other = Transcript { magic: *b"TR", ..t };
        assert!(!s.verify(Side::Server, &other, &sp), "carried to another protocol");
        assert!(!s.verify(Side::Server, &t, &sp[..31]));
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
    }

    #[test]
    fn an_empty_secret_proves_and_verifies_nothing() {
        let t = Transcript { magic: *b"TW", client: nonce(), server: nonce() };
        let empty = ClusterSecret::new([]);
        for side in [Side::Server, Side::Client] {
            let p = empty.proof(side, &t);
            assert!(!empty.verify(side, &t, &p), "an empty secret verified its own proof");
            assert!(!empty.verify(side, &t, &[0; AUTH_LEN]));
            assert!(!empty.verify(side, &t, &[]));
            assert!(!empty.verify(side, &t, &ClusterSecret::new(b"k").proof(side, &t)));
        }
    }

    #[test]
    fn a_secret_from_a_user_is_checked_at_its_edges() {
        let distinct: Vec<u8> = (0..16).collect();
        ClusterSecret::from_bytes(&distinct).unwrap();
        let e = ClusterSecret::from_bytes(&distinct[..15]).unwrap_err().to_string();
        assert!(e.contains("15 bytes") && e.contains("at least 16"), "{e}");
        assert!(ClusterSecret::from_bytes([]).is_err());
        // Eight distinct byte values pass, seven do not.
        let eight: Vec<u8> = (0..16).map(|i| i % 8).collect();
        ClusterSecret::from_bytes(&eight).unwrap();
        let seven: Vec<u8> = (0..16).map(|i| i % 7).collect();
        let e = ClusterSecret::from_bytes(&seven).unwrap_err().to_string();
        assert!(e.contains("not random"), "{e}");
    }
}
