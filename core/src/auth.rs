//! Cluster-secret authentication for the handshake every framed protocol opens with: HMAC-SHA256
//! over both sides' nonces and the protocol's magic, with a different label per direction, so each
//! side proves it knows the secret without revealing it, and a recorded answer cannot be replayed
//! (fresh nonces), reflected (labels) or carried to another protocol (magic).

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

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

/// A secret shared by every member of a cluster. Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<[u8]>);

impl ClusterSecret {
    /// A secret from bytes (use at least 32 random bytes).
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        ClusterSecret(Arc::from(bytes.as_ref()))
    }

    fn mac(
        &self,
        side: Side,
        magic: [u8; 2],
        client: &[u8; AUTH_LEN],
        server: &[u8; AUTH_LEN],
    ) -> Hmac<Sha256> {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(match side {
            Side::Server => SERVER_LABEL,
            Side::Client => CLIENT_LABEL,
        });
        m.update(&magic);
        m.update(client);
        m.update(server);
        m
    }

    /// `side`'s proof for a handshake of the protocol with `magic` and these nonces.
    pub fn proof(
        &self,
        side: Side,
        magic: [u8; 2],
        client: &[u8; AUTH_LEN],
        server: &[u8; AUTH_LEN],
    ) -> [u8; AUTH_LEN] {
        self.mac(side, magic, client, server).finalize().into_bytes().into()
    }

    /// Checks `side`'s proof in constant time.
    pub fn verify(
        &self,
        side: Side,
        magic: [u8; 2],
        client: &[u8; AUTH_LEN],
        server: &[u8; AUTH_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(side, magic, client, server).verify_slice(proof).is_ok()
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
        let (c, v) = (nonce(), nonce());
        let sp = s.proof(Side::Server, *b"TW", &c, &v);
        assert!(s.verify(Side::Server, *b"TW", &c, &v, &sp));
        assert!(!ClusterSecret::new(b"other").verify(Side::Server, *b"TW", &c, &v, &sp));
        assert!(!s.verify(Side::Server, *b"TW", &v, &c, &sp), "swapped nonces");
        assert!(!s.verify(Side::Client, *b"TW", &c, &v, &sp), "a server proof reflected");
        assert!(!s.verify(Side::Server, *b"TR", &c, &v, &sp), "carried to another protocol");
        assert!(!s.verify(Side::Server, *b"TW", &c, &v, &sp[..31]));
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
    }
}
