//! Cluster-secret authentication for the handshake: HMAC-SHA256 over both sides' nonces, with a
//! different label per direction, so each side proves it knows the secret without revealing it and a
//! recorded answer cannot be replayed (fresh nonces) or reflected (labels).

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of handshake nonces and MACs.
pub const AUTH_LEN: usize = 32;

const SERVER_LABEL: &[u8] = b"tensorwire/v1 server proof";
const CLIENT_LABEL: &[u8] = b"tensorwire/v1 client proof";

/// A secret shared by every engine of a cluster. Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<[u8]>);

impl ClusterSecret {
    /// A secret from bytes (use at least 32 random bytes).
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        ClusterSecret(Arc::from(bytes.as_ref()))
    }

    fn mac(&self, label: &[u8], first: &[u8; AUTH_LEN], second: &[u8; AUTH_LEN]) -> Hmac<Sha256> {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(label);
        m.update(first);
        m.update(second);
        m
    }

    /// The server's proof for (client nonce, server nonce).
    pub fn server_proof(&self, client: &[u8; AUTH_LEN], server: &[u8; AUTH_LEN]) -> [u8; AUTH_LEN] {
        self.mac(SERVER_LABEL, client, server).finalize().into_bytes().into()
    }

    /// The client's proof for (server nonce, client nonce).
    pub fn client_proof(&self, server: &[u8; AUTH_LEN], client: &[u8; AUTH_LEN]) -> [u8; AUTH_LEN] {
        self.mac(CLIENT_LABEL, server, client).finalize().into_bytes().into()
    }

    /// Checks a server proof in constant time.
    pub fn verify_server(
        &self,
        client: &[u8; AUTH_LEN],
        server: &[u8; AUTH_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(SERVER_LABEL, client, server).verify_slice(proof).is_ok()
    }

    /// Checks a client proof in constant time.
    pub fn verify_client(
        &self,
        server: &[u8; AUTH_LEN],
        client: &[u8; AUTH_LEN],
        proof: &[u8],
    ) -> bool {
        self.mac(CLIENT_LABEL, server, client).verify_slice(proof).is_ok()
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
    fn proofs_verify_only_with_the_same_secret_nonces_and_direction() {
        let s = ClusterSecret::new(b"cluster secret");
        let (c, v) = (nonce(), nonce());
        let sp = s.server_proof(&c, &v);
        assert!(s.verify_server(&c, &v, &sp));
        assert!(!ClusterSecret::new(b"other").verify_server(&c, &v, &sp));
        assert!(!s.verify_server(&v, &c, &sp), "swapped nonces");
        assert!(!s.verify_client(&v, &c, &sp), "a server proof reflected as a client proof");
        assert!(!s.verify_server(&c, &v, &sp[..31]));
        let cp = s.client_proof(&v, &c);
        assert!(s.verify_client(&v, &c, &cp));
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
    }
}
