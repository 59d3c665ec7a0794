//! The control channel's messages (core's backend channel, framed "TN"): a pure codec, total on
//! any input.
//!
//! The initiator (rank 0) opens with `Hello` carrying the communicator's unique id; both sides
//! join it and the target answers `HelloAck`. Each op is a `Request` (region, key, offset,
//! length, direction) that the target checks through the engine: granted, it posts its half of
//! the pair at once (a receive for a WRITE, a send for a READ) and answers `Grant`; the
//! initiator posts the other half when the grant arrives. Both sides post in request order, so
//! NCCL's in-order matching pairs them. A WRITE ends at the target's `Done` (its receive ended),
//! a READ when the initiator's receive ends. `Refused` carries the engine's error. `Notify` /
//! `NotifyAck` carry notifications; `Bye` ends the connection.

use bytes::Bytes;
use tensorwire_core::backend::kit::{
    Framing, MAX_ERROR_BYTES, MAX_NOTIFY_WIRE, Reader, Writer, decode_error, encode_error,
};
use tensorwire_core::{AccessKey, Error, RegionId, Result};

use crate::comm::UniqueId;

/// The control channel's framing ("TN").
pub const FRAMING: Framing =
    Framing { name: "nccl control", magic: *b"TN", version: 1, max_payload: 256 << 10 };

/// A control message.
#[derive(Debug, Clone)]
pub enum Msg {
    /// Initiator: join this communicator as rank 1.
    Hello {
        /// The unique id.
        id: UniqueId,
    },
    /// Target: joined (or why not).
    HelloAck {
        /// `None` when joined.
        error: Option<Error>,
    },
    /// Initiator: an op on a region of the target.
    Request {
        /// Request id (the op's).
        req: u64,
        /// WRITE (else READ).
        write: bool,
        /// Region.
        region: RegionId,
        /// Access key.
        key: AccessKey,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Target: granted; its half is posted.
    Grant {
        /// Request id.
        req: u64,
    },
    /// Target: refused (the engine's error).
    Refused {
        /// Request id.
        req: u64,
        /// Why.
        error: Error,
    },
    /// Target: the receive of a granted WRITE ended.
    Done {
        /// Request id.
        req: u64,
        /// `None` when the bytes are in place.
        error: Option<Error>,
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
    /// Either side: the connection is over.
    Bye,
}

fn put_error(w: &mut Writer, e: Option<&Error>) {
    w.opt(e, |w, e| {
        w.bytes(&encode_error(e));
    });
}

fn get_error(r: &mut Reader<'_>) -> Result<Option<Error>> {
    r.opt("error", |r| decode_error(r.bytes(MAX_ERROR_BYTES, "error")?))
}

impl Msg {
    /// The frame kind.
    pub fn kind(&self) -> u8 {
        match self {
            Msg::Hello { .. } => 1,
            Msg::HelloAck { .. } => 2,
            Msg::Request { .. } => 3,
            Msg::Grant { .. } => 4,
            Msg::Refused { .. } => 5,
            Msg::Done { .. } => 6,
            Msg::Notify { .. } => 7,
            Msg::NotifyAck { .. } => 8,
            Msg::Bye => 9,
        }
    }

    /// The frame payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Msg::Hello { id } => {
                w.raw(id);
            }
            Msg::HelloAck { error } => put_error(&mut w, error.as_ref()),
            Msg::Request { req, write, region, key, offset, len } => {
                w.u64(*req).bool(*write).u64(region.0).u128(key.to_bits());
                w.u64(*offset).u64(*len);
            }
            Msg::Grant { req } => {
                w.u64(*req);
            }
            Msg::Refused { req, error } => {
                w.u64(*req).bytes(&encode_error(error));
            }
            Msg::Done { req, error } | Msg::NotifyAck { req, error } => {
                w.u64(*req);
                put_error(&mut w, error.as_ref());
            }
            Msg::Notify { req, msg } => {
                w.u64(*req).bytes(msg);
            }
            Msg::Bye => {}
        }
        w.finish()
    }

    /// Decodes a frame of kind `kind`; every malformed input is an error, never a panic.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Msg> {
        let mut r = Reader::new(payload, "nccl control message");
        let m = match kind {
            1 => {
                let mut id = [0u8; 128];
                id.copy_from_slice(r.raw(128)?);
                Msg::Hello { id }
            }
            2 => Msg::HelloAck { error: get_error(&mut r)? },
            3 => {
                let req = r.u64()?;
                let write = r.bool("write")?;
                Msg::Request {
                    req,
                    write,
                    region: RegionId(r.u64()?),
                    key: AccessKey::from_bits(r.u128()?),
                    offset: r.u64()?,
                    len: r.u64()?,
                }
            }
            4 => Msg::Grant { req: r.u64()? },
            5 => Msg::Refused {
                req: r.u64()?,
                error: decode_error(r.bytes(MAX_ERROR_BYTES, "error")?)?,
            },
            6 => Msg::Done { req: r.u64()?, error: get_error(&mut r)? },
            7 => {
                Msg::Notify { req: r.u64()?, msg: r.owned_bytes(MAX_NOTIFY_WIRE, "notification")? }
            }
            8 => Msg::NotifyAck { req: r.u64()?, error: get_error(&mut r)? },
            9 => Msg::Bye,
            k => return Err(Error::protocol(format!("nccl control: unknown message kind {k}"))),
        };
        r.finish()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Msg> {
        let e = Error::AccessDenied("region 3 does not grant remote write".into());
        vec![
            Msg::Hello { id: [7; 128] },
            Msg::HelloAck { error: None },
            Msg::HelloAck { error: Some(e.clone()) },
            Msg::Request {
                req: 9,
                write: true,
                region: RegionId(3),
                key: AccessKey::from_bits(42),
                offset: 4096,
                len: 1 << 20,
            },
            Msg::Grant { req: 9 },
            Msg::Refused { req: 9, error: e.clone() },
            Msg::Done { req: 9, error: None },
            Msg::Done { req: 10, error: Some(e.clone()) },
            Msg::Notify { req: 1, msg: Bytes::from_static(b"chunk") },
            Msg::NotifyAck { req: 1, error: Some(e) },
            Msg::Bye,
        ]
    }

    #[test]
    fn every_message_roundtrips() {
        for m in samples() {
            let enc = m.encode();
            assert_eq!(Msg::decode(m.kind(), &enc).unwrap().encode(), enc, "{m:?}");
            if !enc.is_empty() {
                assert!(Msg::decode(m.kind(), &enc[..enc.len() - 1]).is_err(), "{m:?} cut");
            }
        }
        assert!(Msg::decode(0, &[]).is_err());
    }

    proptest! {
        #[test]
        fn decode_is_total(kind in 0u8..12, buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(m) = Msg::decode(kind, &buf) {
                prop_assert_eq!(m.kind(), kind);
                let enc = m.encode();
                prop_assert_eq!(Msg::decode(kind, &enc).unwrap().encode(), enc);
            }
        }
    }
}
