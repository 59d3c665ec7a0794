//! The engine descriptor exchanged in the P2P handshake: engine id, host identity, each backend's
//! endpoint blob, and the regions this peer may see.

use bytes::Bytes;

use crate::error::Result;
use crate::ids::EngineId;
use crate::region::{MAX_BLOB_BYTES, RemoteRegion};
use crate::wire::codec::{Reader, Writer};

/// Most backends one engine advertises.
pub(crate) const MAX_BACKENDS: usize = 16;
/// Most regions one descriptor carries.
pub(crate) const MAX_REGIONS: usize = 4096;
/// Longest host identity.
pub(crate) const MAX_HOST: usize = 255;

/// What an engine tells a peer about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDescriptor {
    /// Engine identity.
    pub engine: EngineId,
    /// Host identity (engines with the same host id may use same-host backends).
    pub host: String,
    /// Backend name -> endpoint blob, in the engine's order of preference.
    pub backends: Vec<(String, Bytes)>,
    /// Regions the peer may address.
    pub regions: Vec<RemoteRegion>,
}

impl EngineDescriptor {
    /// Encodes the descriptor.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u128(self.engine.0).str(&self.host);
        w.u32(self.backends.len() as u32);
        for (n, b) in &self.backends {
            w.str(n).bytes(b);
        }
        w.u32(self.regions.len() as u32);
        for r in &self.regions {
            r.encode(&mut w);
        }
        w.finish()
    }

    /// Decodes a descriptor; never panics, rejects trailing bytes.
    pub fn decode(buf: &[u8]) -> Result<EngineDescriptor> {
        let mut r = Reader::new(buf, "engine descriptor");
        let engine = EngineId(r.u128()?);
        let host = r.str(MAX_HOST, "host id")?;
        let nb = r.count(MAX_BACKENDS, "backends")?;
        let mut backends = Vec::with_capacity(nb);
        for _ in 0..nb {
            let name = r.str(64, "backend name")?;
            backends.push((name, r.owned_bytes(MAX_BLOB_BYTES, "endpoint blob")?));
        }
        let nr = r.count(MAX_REGIONS, "regions")?;
        let mut regions = Vec::new();
        for _ in 0..nr {
            regions.push(RemoteRegion::decode(&mut r)?);
        }
        r.finish()?;
        Ok(EngineDescriptor { engine, host, backends, regions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{AccessKey, RegionId};
    use crate::memory::MemoryKind;
    use crate::region::Permissions;
    use proptest::prelude::*;

    fn sample() -> EngineDescriptor {
        EngineDescriptor {
            engine: EngineId(7),
            host: "host-a".into(),
            backends: vec![("mem".into(), Bytes::from_static(b"\x01\x02"))],
            regions: vec![RemoteRegion {
                engine: EngineId(7),
                id: RegionId(3),
                key: AccessKey::from_bits(99),
                len: 4096,
                kind: MemoryKind::Device { ordinal: 1 },
                perms: Permissions::READ,
                blobs: vec![("mem".into(), Bytes::new())],
            }],
        }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        assert_eq!(EngineDescriptor::decode(&d.encode()).unwrap(), d);
    }

    #[test]
    fn truncations_and_trailing_bytes_are_errors() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            assert!(EngineDescriptor::decode(&bytes[..cut]).is_err(), "cut at {cut} decoded");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(EngineDescriptor::decode(&extra).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = EngineDescriptor::decode(&bytes);
        }

        #[test]
        fn mutated_descriptors_never_panic(pos in 0usize..200, val in any::<u8>()) {
            let mut bytes = sample().encode();
            let i = pos % bytes.len();
            bytes[i] = val;
            let _ = EngineDescriptor::decode(&bytes);
        }
    }
}
