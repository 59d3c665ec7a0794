//! The two public blobs of the backend, pure codecs, total on any input:
//! - the endpoint (in the engine descriptor): the control channel's address and, per NIC, what
//!   a peer needs to pair its NICs with ours and connect QPs to them;
//! - a region's blob (in its `RemoteRegion`): the region's rkey on each NIC that registered it.
//!   A key grants nothing by itself: an op also needs the target's lease (see `wire`), which
//!   carries the addresses and is granted only after the engine checked region, key, permission
//!   and bounds.

use std::net::SocketAddr;

use tensorwire_core::backend::kit::{Reader, Writer};
use tensorwire_core::{Error, Result};

use crate::verbs::LinkLayer;
pub use crate::verbs::NicAddress;

/// Version of both blobs.
pub const VERSION: u8 = 1;
/// Most NICs an endpoint lists.
pub const MAX_NICS: usize = 32;
const MAX_NAME: usize = 64;
const MAX_ADDR: usize = 128;

/// The backend's endpoint blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The control channel's address.
    pub control: SocketAddr,
    /// The NICs, in index order (a region blob and the control messages name them by index).
    pub nics: Vec<NicAddress>,
}

fn link_tag(l: LinkLayer) -> u8 {
    match l {
        LinkLayer::Infiniband => 1,
        LinkLayer::Ethernet => 2,
    }
}

impl Endpoint {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(VERSION).str(&self.control.to_string()).u32(self.nics.len() as u32);
        for n in &self.nics {
            w.str(&n.name).u8(n.port).u16(n.lid).raw(&n.gid).u8(n.gid_index);
            w.u8(link_tag(n.link)).u8(n.mtu).u64(n.fabric);
        }
        w.finish()
    }

    /// Decodes; every malformed input is an error.
    pub fn decode(buf: &[u8]) -> Result<Endpoint> {
        let mut r = Reader::new(buf, "rdma endpoint");
        version(&mut r)?;
        let addr = r.str(MAX_ADDR, "control address")?;
        let control = addr
            .parse()
            .map_err(|_| Error::protocol(format!("rdma endpoint: bad address {addr:?}")))?;
        let n = r.count(MAX_NICS, "NICs")?;
        let mut nics = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str(MAX_NAME, "NIC name")?;
            let (port, lid) = (r.u8()?, r.u16()?);
            let mut gid = [0u8; 16];
            gid.copy_from_slice(r.raw(16)?);
            let gid_index = r.u8()?;
            let link = match r.u8()? {
                1 => LinkLayer::Infiniband,
                2 => LinkLayer::Ethernet,
                t => return Err(Error::protocol(format!("rdma endpoint: link layer {t}"))),
            };
            let (mtu, fabric) = (r.u8()?, r.u64()?);
            nics.push(NicAddress { name, port, lid, gid, gid_index, link, mtu, fabric });
        }
        r.finish()?;
        Ok(Endpoint { control, nics })
    }
}

fn version(r: &mut Reader<'_>) -> Result<()> {
    match r.u8()? {
        VERSION => Ok(()),
        v => Err(Error::protocol(format!(
            "rdma blob version {v} not supported (this build speaks {VERSION})"
        ))),
    }
}

/// A region's keys: (NIC index in the owner's endpoint, rkey), one per NIC that registered it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegionKeys(pub Vec<(u8, u32)>);

impl RegionKeys {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(VERSION).u32(self.0.len() as u32);
        for &(nic, rkey) in &self.0 {
            w.u8(nic).u32(rkey);
        }
        w.finish()
    }

    /// Decodes; every malformed input is an error.
    pub fn decode(buf: &[u8]) -> Result<RegionKeys> {
        let mut r = Reader::new(buf, "rdma region blob");
        version(&mut r)?;
        let n = r.count(MAX_NICS, "keys")?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push((r.u8()?, r.u32()?));
        }
        r.finish()?;
        Ok(RegionKeys(keys))
    }

    /// The rkey on NIC `nic`, if the region is registered there.
    pub fn on(&self, nic: u8) -> Option<u32> {
        self.0.iter().find(|(n, _)| *n == nic).map(|&(_, k)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nic(i: u8) -> NicAddress {
        NicAddress {
            name: format!("mlx5_{i}"),
            port: 1,
            lid: u16::from(i) + 7,
            gid: [i; 16],
            gid_index: 3,
            link: if i % 2 == 0 { LinkLayer::Ethernet } else { LinkLayer::Infiniband },
            mtu: 5,
            fabric: 0xfe80 + u64::from(i),
        }
    }

    #[test]
    fn endpoints_and_keys_roundtrip() {
        let e = Endpoint { control: "10.0.0.7:7003".parse().unwrap(), nics: vec![nic(0), nic(1)] };
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
        let k = RegionKeys(vec![(0, 0x1234), (1, 0xdead_beef)]);
        let d = RegionKeys::decode(&k.encode()).unwrap();
        assert_eq!((d.on(1), d.on(2)), (Some(0xdead_beef), None));
        let mut bad = k.encode();
        bad[0] = 9;
        assert!(RegionKeys::decode(&bad).unwrap_err().to_string().contains("version 9"));
    }

    proptest! {
        #[test]
        fn decoders_are_total(buf in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(e) = Endpoint::decode(&buf) {
                prop_assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
            }
            if let Ok(k) = RegionKeys::decode(&buf) {
                prop_assert_eq!(k.encode(), buf);
            }
        }

        #[test]
        fn mutated_endpoints_never_panic(at in 0usize..200, byte: u8) {
            let e = Endpoint { control: "127.0.0.1:1".parse().unwrap(), nics: vec![nic(0), nic(3)] };
            let mut enc = e.encode();
            if at < enc.len() {
                enc[at] = byte;
            }
            let _ = Endpoint::decode(&enc);
        }
    }
}
