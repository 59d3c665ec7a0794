//! The control channel's messages: one TCP connection per backend connection, opened with the
//! engine's authenticated handshake, framed with core's [`Framing`] (kind = message kind). Data
//! never travels here: it moves by RDMA WRITE and READ once the target leased the region. A pure
//! codec, total on any input.
//!
//! The initiator (client) opens with `Hello`, offering one QP per rail (its NIC, the target NIC
//! it pairs with, the QP's address); the target makes and connects a QP for each and answers
//! `HelloAck` with its own addresses (or why a rail could not be made). Then:
//! - `Lease` asks for a region for one access; the target checks it through the engine (region,
//!   key, permission, bounds of the whole region) and answers `Granted` (the region's length and
//!   its address on each NIC) or `Refused` (the engine's error). The target holds a leased
//!   region (deregistration waits) until `Released`.
//! - `Forget` (target): the region is being deregistered; the initiator stops using the lease
//!   and, once its requests on it have completed, answers `Released`.
//! - `Notify` carries a notification, `NotifyAck` says it was delivered (or the error).
//! - `Rail` replaces the QP of a rail whose QP failed; `RailAck` answers as `HelloAck` does.
//! - `Bye`: the connection is over.

use bytes::Bytes;
use tensorwire_core::backend::kit::{
    Framing, MAX_ERROR_BYTES, MAX_NOTIFY_WIRE, Reader, Writer, decode_error, encode_error,
};
use tensorwire_core::{AccessKey, Error, RegionId, Result};

use crate::blob::MAX_NICS;
use crate::verbs::QpAddress;

/// The control channel's framing ("TV"; version 2: version 1 shared the store RPC's magic "TR").
pub const FRAMING: Framing =
    Framing { name: "rdma control", magic: *b"TV", version: 2, max_payload: 256 << 10 };
/// Most rails (QPs) one connection has.
pub const MAX_RAILS: usize = 256;

/// One rail a `Hello` or `Rail` offers: the initiator's NIC, the target's NIC, the initiator's QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RailOffer {
    /// Initiator NIC index.
    pub local_nic: u8,
    /// Target NIC index (in the target's endpoint).
    pub remote_nic: u8,
    /// The initiator's QP.
    pub qp: QpAddress,
}

/// A control message.
#[derive(Debug, Clone)]
pub enum Msg {
    /// Initiator: a new connection with these rails.
    Hello {
        /// Rails, in order.
        rails: Vec<RailOffer>,
    },
    /// Target: per rail, its QP or why it could not make one.
    HelloAck {
        /// One answer per offered rail, in order.
        rails: Vec<std::result::Result<QpAddress, Error>>,
    },
    /// Initiator: lease `region` for READs (or WRITEs with `write`).
    Lease {
        /// Request id.
        req: u64,
        /// Region.
        region: RegionId,
        /// Access key.
        key: AccessKey,
        /// WRITE access (else READ).
        write: bool,
    },
    /// Target: leased.
    Granted {
        /// Request id.
        req: u64,
        /// The region's length.
        len: u64,
        /// The address of the region's first byte on each of the target's NICs that registered
        /// it: (NIC index, address).
        bases: Vec<(u8, u64)>,
    },
    /// Target: the lease is refused (the engine's error).
    Refused {
        /// Request id.
        req: u64,
        /// Why.
        error: Error,
    },
    /// Target: `region` is going; give its leases back.
    Forget {
        /// Region.
        region: RegionId,
    },
    /// Initiator: its lease of `region` for `write` access is over.
    Released {
        /// Region.
        region: RegionId,
        /// The write lease (else the read lease).
        write: bool,
    },
    /// Initiator: a notification.
    Notify {
        /// Request id.
        req: u64,
        /// The engine's message.
        msg: Bytes,
    },
    /// Target: delivered, or the error.
    NotifyAck {
        /// Request id.
        req: u64,
        /// `None` when delivered.
        error: Option<Error>,
    },
    /// Initiator: replace rail `rail`'s QP with this one.
    Rail {
        /// Request id.
        req: u64,
        /// Rail index (order of the `Hello`).
        rail: u16,
        /// The new QP (same NICs as before).
        offer: RailOffer,
    },
    /// Target: the rail's new QP, or why not.
    RailAck {
        /// Request id.
        req: u64,
        /// The target's new QP.
        answer: std::result::Result<QpAddress, Error>,
    },
    /// Either side: the connection is over.
    Bye,
}

fn put_qp(w: &mut Writer, q: &QpAddress) {
    w.u32(q.qpn).u32(q.psn).u16(q.lid).raw(&q.gid).u8(q.mtu);
}

fn get_qp(r: &mut Reader<'_>) -> Result<QpAddress> {
    let (qpn, psn, lid) = (r.u32()?, r.u32()?, r.u16()?);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(r.raw(16)?);
    Ok(QpAddress { qpn, psn, lid, gid, mtu: r.u8()? })
}

fn put_offer(w: &mut Writer, o: &RailOffer) {
    w.u8(o.local_nic).u8(o.remote_nic);
    put_qp(w, &o.qp);
}

fn get_offer(r: &mut Reader<'_>) -> Result<RailOffer> {
    Ok(RailOffer { local_nic: r.u8()?, remote_nic: r.u8()?, qp: get_qp(r)? })
}

fn put_answer(w: &mut Writer, a: &std::result::Result<QpAddress, Error>) {
    match a {
        Ok(q) => {
            w.u8(1);
            put_qp(w, q);
        }
        Err(e) => {
            w.u8(0).bytes(&encode_error(e));
        }
    }
}

fn get_answer(r: &mut Reader<'_>) -> Result<std::result::Result<QpAddress, Error>> {
    match r.u8()? {
        1 => Ok(Ok(get_qp(r)?)),
        0 => Ok(Err(decode_error(r.bytes(MAX_ERROR_BYTES, "error")?)?)),
        t => Err(Error::protocol(format!("rdma control: answer tag {t}"))),
    }
}

impl Msg {
    /// The frame kind.
    pub fn kind(&self) -> u8 {
        match self {
            Msg::Hello { .. } => 1,
            Msg::HelloAck { .. } => 2,
            Msg::Lease { .. } => 3,
            Msg::Granted { .. } => 4,
            Msg::Refused { .. } => 5,
            Msg::Forget { .. } => 6,
            Msg::Released { .. } => 7,
            Msg::Notify { .. } => 8,
            Msg::NotifyAck { .. } => 9,
            Msg::Rail { .. } => 10,
            Msg::RailAck { .. } => 11,
            Msg::Bye => 12,
        }
    }

    /// The frame payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Msg::Hello { rails } => {
                w.u32(rails.len() as u32);
                rails.iter().for_each(|o| put_offer(&mut w, o));
            }
            Msg::HelloAck { rails } => {
                w.u32(rails.len() as u32);
                rails.iter().for_each(|a| put_answer(&mut w, a));
            }
            Msg::Lease { req, region, key, write } => {
                w.u64(*req).u64(region.0).u128(key.to_bits()).bool(*write);
            }
            Msg::Granted { req, len, bases } => {
                w.u64(*req).u64(*len).u32(bases.len() as u32);
                for &(nic, base) in bases {
                    w.u8(nic).u64(base);
                }
            }
            Msg::Refused { req, error } => {
                w.u64(*req).bytes(&encode_error(error));
            }
            Msg::Forget { region } => {
                w.u64(region.0);
            }
            Msg::Released { region, write } => {
                w.u64(region.0).bool(*write);
            }
            Msg::Notify { req, msg } => {
                w.u64(*req).bytes(msg);
            }
            Msg::NotifyAck { req, error } => {
                w.u64(*req).opt(error.as_ref(), |w, e| {
                    w.bytes(&encode_error(e));
                });
            }
            Msg::Rail { req, rail, offer } => {
                w.u64(*req).u16(*rail);
                put_offer(&mut w, offer);
            }
            Msg::RailAck { req, answer } => {
                w.u64(*req);
                put_answer(&mut w, answer);
            }
            Msg::Bye => {}
        }
        w.finish()
    }

    /// Decodes a frame of kind `kind`; every malformed input is an error, never a panic.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Msg> {
        let mut r = Reader::new(payload, "rdma control message");
        let m = match kind {
            1 => {
                let n = r.count(MAX_RAILS, "rails")?;
                let rails = (0..n).map(|_| get_offer(&mut r)).collect::<Result<_>>()?;
                Msg::Hello { rails }
            }
            2 => {
                let n = r.count(MAX_RAILS, "rails")?;
                let rails = (0..n).map(|_| get_answer(&mut r)).collect::<Result<_>>()?;
                Msg::HelloAck { rails }
            }
            3 => Msg::Lease {
                req: r.u64()?,
                region: RegionId(r.u64()?),
                key: AccessKey::from_bits(r.u128()?),
                write: r.bool("write")?,
            },
            4 => {
                let (req, len) = (r.u64()?, r.u64()?);
                let n = r.count(MAX_NICS, "bases")?;
                let bases = (0..n).map(|_| Ok((r.u8()?, r.u64()?))).collect::<Result<_>>()?;
                Msg::Granted { req, len, bases }
            }
            5 => Msg::Refused {
                req: r.u64()?,
                error: decode_error(r.bytes(MAX_ERROR_BYTES, "error")?)?,
            },
            6 => Msg::Forget { region: RegionId(r.u64()?) },
            7 => Msg::Released { region: RegionId(r.u64()?), write: r.bool("write")? },
            8 => {
                Msg::Notify { req: r.u64()?, msg: r.owned_bytes(MAX_NOTIFY_WIRE, "notification")? }
            }
            9 => {
                let req = r.u64()?;
                let error = r.opt("error", |r| decode_error(r.bytes(MAX_ERROR_BYTES, "error")?))?;
                Msg::NotifyAck { req, error }
            }
            10 => Msg::Rail { req: r.u64()?, rail: r.u16()?, offer: get_offer(&mut r)? },
            11 => Msg::RailAck { req: r.u64()?, answer: get_answer(&mut r)? },
            12 => Msg::Bye,
            k => return Err(Error::protocol(format!("rdma control: unknown message kind {k}"))),
        };
        r.finish()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn qp(n: u32) -> QpAddress {
        QpAddress { qpn: n, psn: n * 3, lid: 9, gid: [n as u8; 16], mtu: 5 }
    }

    fn samples() -> Vec<Msg> {
        let offer = RailOffer { local_nic: 1, remote_nic: 0, qp: qp(7) };
        vec![
            Msg::Hello { rails: vec![offer, offer] },
            Msg::HelloAck {
                rails: vec![
                    Ok(qp(3)),
                    Err(Error::Unsupported { backend: "rdma", what: "x".into() }),
                ],
            },
            Msg::Lease {
                req: 5,
                region: RegionId(9),
                key: AccessKey::from_bits(u128::MAX - 3),
                write: true,
            },
            Msg::Granted { req: 5, len: 4096, bases: vec![(0, 0x7f00_0000), (1, 0x7f00_0000)] },
            Msg::Refused { req: 6, error: Error::AccessDenied("wrong key".into()) },
            Msg::Forget { region: RegionId(9) },
            Msg::Released { region: RegionId(9), write: false },
            Msg::Notify { req: 1, msg: Bytes::from_static(b"chunk 3") },
            Msg::NotifyAck { req: 1, error: None },
            Msg::NotifyAck { req: 2, error: Some(Error::PeerClosed("gone".into())) },
            Msg::Rail { req: 3, rail: 2, offer },
            Msg::RailAck { req: 3, answer: Ok(qp(11)) },
            Msg::Bye,
        ]
    }

    #[test]
    fn every_message_roundtrips() {
        for m in samples() {
            let enc = m.encode();
            assert_eq!(Msg::decode(m.kind(), &enc).unwrap().encode(), enc, "{m:?}");
            assert!(enc.len() as u32 <= FRAMING.max_payload);
            if !enc.is_empty() {
                assert!(Msg::decode(m.kind(), &enc[..enc.len() - 1]).is_err(), "{m:?} cut");
            }
        }
        assert!(Msg::decode(99, &[]).is_err());
        assert!(Msg::decode(12, &[0]).is_err(), "trailing bytes");
    }

    proptest! {
        #[test]
        fn decode_is_total(kind in 0u8..16, buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(m) = Msg::decode(kind, &buf) {
                prop_assert_eq!(m.kind(), kind);
                let enc = m.encode();
                prop_assert_eq!(Msg::decode(kind, &enc).unwrap().encode(), enc);
            }
        }

        #[test]
        fn mutated_messages_never_panic(i in 0usize..13, at in 0usize..120, byte: u8) {
            let m = &samples()[i];
            let mut enc = m.encode();
            if at < enc.len() {
                enc[at] = byte;
            }
            let _ = Msg::decode(m.kind(), &enc);
        }
    }
}
