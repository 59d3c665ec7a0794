//! Handshake messages (the payloads of control frames):
//! 1. client -> server `Open`: the client's nonce;
//! 2. server -> client `Challenge`: the server's nonce and, when it has a cluster secret, its proof;
//! 3. client -> server `Hello`: the client's proof (when it has a secret) and its descriptor;
//! 4. server -> client `Hello`: the server's descriptor (or a `Reject` frame with the reason).
//!
//! Descriptors (which carry region keys) are sent only after the peer has authenticated.

use crate::auth::AUTH_LEN;
use crate::error::Result;
use crate::wire::codec::{Reader, Writer};
use crate::wire::descriptor::EngineDescriptor;

fn get_array(r: &mut Reader<'_>) -> Result<[u8; AUTH_LEN]> {
    let mut out = [0u8; AUTH_LEN];
    for b in &mut out {
        *b = r.u8()?;
    }
    Ok(out)
}

fn get_proof(r: &mut Reader<'_>) -> Result<Option<[u8; AUTH_LEN]>> {
    match r.u8()? {
        0 => Ok(None),
        1 => Ok(Some(get_array(r)?)),
        t => Err(crate::error::Error::protocol(format!("handshake: bad proof flag {t}"))),
    }
}

fn put_proof(w: &mut Writer, proof: &Option<[u8; AUTH_LEN]>) {
    match proof {
        None => {
            w.u8(0);
        }
        Some(p) => {
            w.u8(1).raw(p);
        }
    }
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
        let mut w = Writer::new();
        w.raw(&self.nonce);
        w.finish()
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

/// Steps 3 and 4: an optional proof and a descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Client proof (absent in the server's Hello, or when the client has no secret).
    pub proof: Option<[u8; AUTH_LEN]>,
    /// The sender's descriptor.
    pub descriptor: EngineDescriptor,
}

impl Hello {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        put_proof(&mut w, &self.proof);
        w.raw(&self.descriptor.encode());
        w.finish()
    }
    /// Decodes; never panics.
    pub fn decode(buf: &[u8]) -> Result<Hello> {
        let mut r = Reader::new(buf, "handshake hello");
        let proof = get_proof(&mut r)?;
        let descriptor = EngineDescriptor::decode(r.rest())?;
        Ok(Hello { proof, descriptor })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::EngineId;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        let o = Open { nonce: [7; AUTH_LEN] };
        assert_eq!(Open::decode(&o.encode()).unwrap(), o);
        for proof in [None, Some([9; AUTH_LEN])] {
            let c = Challenge { nonce: [1; AUTH_LEN], proof };
            assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
            let h = Hello {
                proof,
                descriptor: EngineDescriptor {
                    engine: EngineId(3),
                    host: "h".into(),
                    backends: vec![],
                    regions: vec![],
                },
            };
            assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        }
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Open::decode(&bytes);
            let _ = Challenge::decode(&bytes);
            let _ = Hello::decode(&bytes);
        }
    }
}
