//! The authenticated handshake's messages (payloads of frames with the reserved kinds):
//! 1. client -> server `Open`: the client's nonce;
//! 2. server -> client `Challenge`: the server's nonce and, with a cluster secret, its proof;
//! 3. client -> server `Proof`: the client's proof (with a secret).
//!
//! Then come the protocol's own messages, or a `Reject` frame (UTF-8 reason) from either side.
//! Every decoder is total.

use crate::auth::AUTH_LEN;
use crate::error::Result;
use crate::wire::codec::{Reader, Writer};
use crate::wire::frame::RESERVED_KINDS;

/// Frame kind of `Open`.
pub const OPEN: u8 = RESERVED_KINDS;
/// Frame kind of `Challenge`.
pub const CHALLENGE: u8 = RESERVED_KINDS + 1;
/// Frame kind of `Proof`.
pub const PROOF: u8 = RESERVED_KINDS + 2;
/// Frame kind of a refusal (payload: the reason, UTF-8).
pub const REJECT: u8 = RESERVED_KINDS + 3;

fn get_array(r: &mut Reader<'_>) -> Result<[u8; AUTH_LEN]> {
    let mut out = [0u8; AUTH_LEN];
    out.copy_from_slice(r.raw(AUTH_LEN)?);
    Ok(out)
}

fn get_proof(r: &mut Reader<'_>) -> Result<Option<[u8; AUTH_LEN]>> {
    r.opt("proof", get_array)
}

fn put_proof(w: &mut Writer, proof: &Option<[u8; AUTH_LEN]>) {
    w.opt(proof.as_ref(), |w, p| {
        w.raw(p);
    });
}

/// Step 1: the client's nonce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// Client nonce.
    pub nonce: [u8; AUTH_LEN],
}

impl Open {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        self.nonce.to_vec()
    }
    /// Decodes; never panics.
    pub fn decode(buf: &[u8]) -> Result<Open> {
        let mut r = Reader::new(buf, "handshake open");
        let nonce = get_array(&mut r)?;
        r.finish()?;
        Ok(Open { nonce })
    }
}

/// Step 2: the server's nonce and proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Server nonce.
    pub nonce: [u8; AUTH_LEN],
    /// Server proof, present when the server has a cluster secret.
    pub proof: Option<[u8; AUTH_LEN]>,
}

impl Challenge {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(&self.nonce);
        put_proof(&mut w, &self.proof);
        w.finish()
    }
    /// Decodes; never panics.
    pub fn decode(buf: &[u8]) -> Result<Challenge> {
        let mut r = Reader::new(buf, "handshake challenge");
        let nonce = get_array(&mut r)?;
        let proof = get_proof(&mut r)?;
        r.finish()?;
        Ok(Challenge { nonce, proof })
    }
}

/// Step 3: the client's proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    /// Client proof, present when the client has a cluster secret.
    pub proof: Option<[u8; AUTH_LEN]>,
}

impl Proof {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        put_proof(&mut w, &self.proof);
        w.finish()
    }
    /// Decodes; never panics.
    pub fn decode(buf: &[u8]) -> Result<Proof> {
        let mut r = Reader::new(buf, "handshake proof");
        let proof = get_proof(&mut r)?;
        r.finish()?;
        Ok(Proof { proof })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let o = Open { nonce: [7; AUTH_LEN] };
        assert_eq!(Open::decode(&o.encode()).unwrap(), o);
        for proof in [None, Some([9; AUTH_LEN])] {
            let c = Challenge { nonce: [1; AUTH_LEN], proof };
            assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
            let p = Proof { proof };
            assert_eq!(Proof::decode(&p.encode()).unwrap(), p);
        }
        assert!(Proof::decode(&[2]).is_err());
        assert!(Open::decode(&[0; AUTH_LEN + 1]).is_err());
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Open::decode(&bytes);
            let _ = Challenge::decode(&bytes);
            let _ = Proof::decode(&bytes);
        }
    }
}
