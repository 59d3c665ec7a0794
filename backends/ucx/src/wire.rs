//! The control messages the UCX backend sends as active messages (one AM id, everything in the AM
//! data): a fixed 64-byte header and a bounded body. Data never travels in them; it moves by
//! `ucp_put_nbx`/`ucp_get_nbx` once the target granted the op. A pure codec, total on any input.
//!
//! ```text
//! 0..2 magic "TU"  2 version  3 kind  4 flags  5..8 zero
//! 8..16 connection  16..24 request  24..32 region  32..48 access key  48..56 offset  56..64 len
//! ```
//! `offset` of a Granted is the absolute address of the granted range in the target's memory. The
//! body is the initiator's worker address (Hello), the user message (Notify), or an encoded error
//! (Granted, HelloAck or NotifyAck without the OK flag).
//!
//! Leases (version 2): a Begin with [`LEASE`] asks to hold the whole region for the connection. A
//! Granted with [`LEASE`] grants it: `offset` is then the region's base address and `len` its
//! length; the initiator runs later ops on it (same key and access) with no Begin and no End. On
//! deregistration the target sends Forget; the initiator stops using the lease, and once its ops
//! on it are over (flushed) answers Released (with [`WRITE`] for a write lease).

use tensorwire_core::backend::kit::{Framing, MAX_ERROR_BYTES, MAX_NOTIFY_WIRE, Reader, Writer};
use tensorwire_core::{AccessKey, Error, RegionId, Result, backend::RemoteRange};

/// Header length.
pub const HEADER_LEN: usize = 64;
/// Largest worker address a Hello carries.
pub const MAX_ADDRESS_BYTES: usize = 16 << 10;
/// The messages' magic ("TU"), version and largest body.
pub const FRAMING: Framing =
    Framing { name: "ucx", magic: *b"TU", version: 2, max_payload: MAX_ADDRESS_BYTES as u32 };

/// Answer flag: the request succeeded (else the body is an encoded error).
pub const OK: u8 = 1;
/// Begin flag: the op writes the region (else it reads it).
pub const WRITE: u8 = 2;
/// Bye flag: sent by the target side of the connection (else by the initiator).
pub const TARGET: u8 = 4;
/// Begin: lease the whole region; Granted: leased (see the module docs).
pub const LEASE: u8 = 8;
const KNOWN_FLAGS: u8 = OK | WRITE | TARGET | LEASE;

/// Message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Initiator: a new connection; the body is the initiator's worker address.
    Hello,
    /// Target: the connection is set up (or the error).
    HelloAck,
    /// Initiator: an op on `[offset, offset+len)` of a region is about to run; check it, hold it.
    Begin,
    /// Target: go ahead at address `offset`, or the error that refuses the op.
    Granted,
    /// Initiator: the op's data movement is over (flushed); release the region.
    End,
    /// Initiator: a notification (the body).
    Notify,
    /// Target: the notification was delivered, or the error.
    NotifyAck,
    /// Either side: this connection is over (shutdown or drop).
    Bye,
    /// Target: `region` is being deregistered; end its leases.
    Forget,
    /// Initiator: its lease on `region` (a write lease with [`WRITE`]) is over, no op on it left.
    Released,
}

impl Kind {
    fn tag(self) -> u8 {
        match self {
            Kind::Hello => 1,
            Kind::HelloAck => 2,
            Kind::Begin => 3,
            Kind::Granted => 4,
            Kind::End => 5,
            Kind::Notify => 6,
            Kind::NotifyAck => 7,
            Kind::Bye => 8,
            Kind::Forget => 9,
            Kind::Released => 10,
        }
    }

    fn from_tag(t: u8) -> Result<Kind> {
        Ok(match t {
            1 => Kind::Hello,
            2 => Kind::HelloAck,
            3 => Kind::Begin,
            4 => Kind::Granted,
            5 => Kind::End,
            6 => Kind::Notify,
            7 => Kind::NotifyAck,
            8 => Kind::Bye,
            9 => Kind::Forget,
            10 => Kind::Released,
            _ => return Err(Error::protocol(format!("ucx: unknown message kind {t}"))),
        })
    }

    /// Largest body this kind may carry.
    fn max_body(self, flags: u8) -> usize {
        match self {
            Kind::Hello => MAX_ADDRESS_BYTES,
            Kind::Notify => MAX_NOTIFY_WIRE,
            Kind::HelloAck | Kind::Granted | Kind::NotifyAck if flags & OK == 0 => MAX_ERROR_BYTES,
            _ => 0,
        }
    }
}

/// A decoded message; `body` borrows the received bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Msg<'a> {
    /// Kind.
    pub kind: Kind,
    /// Flag bits ([`OK`], [`WRITE`]).
    pub flags: u8,
    /// Connection id (chosen by the initiator).
    pub conn: u64,
    /// Request id (per connection).
    pub req: u64,
    /// Region.
    pub region: RegionId,
    /// Access key.
    pub key: AccessKey,
    /// Offset (Begin) or granted address (Granted).
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// Body.
    pub body: &'a [u8],
}

impl<'a> Msg<'a> {
    /// The remote bytes a request names.
    pub fn range(&self) -> RemoteRange {
        RemoteRange { region: self.region, key: self.key, offset: self.offset, len: self.len }
    }

    /// A message with no region fields and no body.
    pub fn new(kind: Kind, conn: u64, req: u64) -> Msg<'static> {
        Msg {
            kind,
            flags: 0,
            conn,
            req,
            region: RegionId(0),
            key: AccessKey::from_bits(0),
            offset: 0,
            len: 0,
            body: &[],
        }
    }

    /// Whether the OK flag is set.
    pub fn ok(&self) -> bool {
        self.flags & OK != 0
    }

    /// Encodes header and body into one buffer.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(&FRAMING.magic).u8(FRAMING.version).u8(self.kind.tag()).u8(self.flags);
        w.raw(&[0; 3]).u64(self.conn).u64(self.req).u64(self.region.0);
        w.u128(self.key.to_bits()).u64(self.offset).u64(self.len).raw(self.body);
        w.finish()
    }

    /// Decodes one message; every malformed input is an error, never a panic.
    pub fn decode(buf: &'a [u8]) -> Result<Msg<'a>> {
        let mut r = Reader::new(buf, "ucx message");
        FRAMING.check_prefix(r.raw(3)?)?;
        let kind = Kind::from_tag(r.u8()?)?;
        let flags = r.u8()?;
        if flags & !KNOWN_FLAGS != 0 || r.raw(3)? != [0; 3] {
            return Err(Error::protocol(format!("ucx: unknown flags {flags:#x}")));
        }
        let (conn, req, region) = (r.u64()?, r.u64()?, RegionId(r.u64()?));
        let (key, offset, len) = (AccessKey::from_bits(r.u128()?), r.u64()?, r.u64()?);
        let body = r.rest();
        FRAMING.check_len(
            &format!("{kind:?} body"),
            body.len() as u64,
            kind.max_body(flags) as u64,
        )?;
        Ok(Msg { kind, flags, conn, req, region, key, offset, len, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind(t: u8) -> Kind {
        Kind::from_tag(t % 10 + 1).unwrap()
    }

    proptest! {
        #[test]
        fn roundtrip(
            t in 0u8..10, flags in 0u8..16, conn: u64, req: u64, region: u64, key: u128,
            offset: u64, len: u64, body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let kind = kind(t);
            let body = if body.len() <= kind.max_body(flags) { body } else { Vec::new() };
            let m = Msg {
                kind, flags, conn, req, region: RegionId(region), key: AccessKey::from_bits(key),
                offset, len, body: &body,
            };
            let enc = m.encode();
            prop_assert_eq!(Msg::decode(&enc).unwrap(), m);
        }

        #[test]
        fn decode_is_total(buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(m) = Msg::decode(&buf) {
                prop_assert_eq!(m.encode(), buf, "decoding is canonical");
            }
        }

        #[test]
        fn decode_survives_mutation(t in 0u8..10, at in 0usize..72, byte: u8) {
            let body = [7u8; 8];
            let mut m = Msg::new(kind(t), 1, 2);
            m.body = if kind(t).max_body(0) >= 8 { &body } else { &[] };
            let mut enc = m.encode();
            if at < enc.len() {
                enc[at] = byte;
            }
            if let Ok(d) = Msg::decode(&enc) {
                prop_assert_eq!(d.encode(), enc, "decoding is canonical");
            }
        }
    }

    #[test]
    fn rejects_oversized_bodies_and_bad_headers() {
        let body = vec![0u8; 16];
        let mut m = Msg::new(Kind::End, 1, 2);
        m.body = &body;
        assert!(Msg::decode(&m.encode()).is_err(), "End carries no body");
        let mut m = Msg::new(Kind::Granted, 1, 2);
        m.flags = OK;
        m.body = &body;
        assert!(Msg::decode(&m.encode()).is_err(), "an OK grant carries no body");
        m.flags = 0;
        assert!(Msg::decode(&m.encode()).is_ok(), "a refusal carries its error");
        let mut enc = Msg::new(Kind::Bye, 0, 0).encode();
        enc[4] = 0x80;
        assert!(Msg::decode(&enc).is_err(), "unknown flag");
        assert!(Msg::decode(&enc[..63]).is_err(), "short header");
    }
}
