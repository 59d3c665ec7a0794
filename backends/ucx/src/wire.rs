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

use tensorwire_core::wire::envelope::MAX_NOTIFY_BYTES;
use tensorwire_core::wire::error::MAX_ERROR_BYTES;
use tensorwire_core::{AccessKey, Error, RegionId, Result};

/// Header length.
pub const HEADER_LEN: usize = 64;
/// Magic.
pub const MAGIC: [u8; 2] = *b"TU";
/// Protocol version.
pub const VERSION: u8 = 1;
/// Largest worker address a Hello carries.
pub const MAX_ADDRESS_BYTES: usize = 16 << 10;
/// Largest notification body (a user payload plus the engine's envelope).
pub const MAX_NOTIFY_WIRE: usize = MAX_NOTIFY_BYTES + 1024;

/// Answer flag: the request succeeded (else the body is an encoded error).
pub const OK: u8 = 1;
/// Begin flag: the op writes the region (else it reads it).
pub const WRITE: u8 = 2;
/// Bye flag: sent by the target side of the connection (else by the initiator).
pub const TARGET: u8 = 4;
const KNOWN_FLAGS: u8 = OK | WRITE | TARGET;

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
        let mut out = Vec::with_capacity(HEADER_LEN + self.body.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.kind.tag());
        out.push(self.flags);
        out.extend_from_slice(&[0; 3]);
        for v in [self.conn, self.req, self.region.0] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.key.to_bits().to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(self.body);
        out
    }

    /// Decodes one message; every malformed input is an error, never a panic.
    pub fn decode(buf: &'a [u8]) -> Result<Msg<'a>> {
        let Some((h, body)) = buf.split_first_chunk::<HEADER_LEN>() else {
            return Err(Error::protocol(format!("ucx: message of {} bytes", buf.len())));
        };
        if h[0..2] != MAGIC {
            return Err(Error::protocol("ucx: bad magic"));
        }
        if h[2] != VERSION {
            return Err(Error::protocol(format!("ucx: protocol version {}", h[2])));
        }
        let kind = Kind::from_tag(h[3])?;
        let flags = h[4];
        if flags & !KNOWN_FLAGS != 0 || h[5..8] != [0; 3] {
            return Err(Error::protocol(format!("ucx: unknown flags {flags:#x}")));
        }
        let max = kind.max_body(flags);
        if body.len() > max {
            return Err(Error::protocol(format!(
                "ucx: {kind:?} body of {} bytes (limit {max})",
                body.len()
            )));
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let mut key = [0u8; 16];
        key.copy_from_slice(&h[32..48]);
        Ok(Msg {
            kind,
            flags,
            conn: u64_at(8),
            req: u64_at(16),
            region: RegionId(u64_at(24)),
            key: AccessKey::from_bits(u128::from_le_bytes(key)),
            offset: u64_at(48),
            len: u64_at(56),
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind(t: u8) -> Kind {
        Kind::from_tag(t % 8 + 1).unwrap()
    }

    proptest! {
        #[test]
        fn roundtrip(
            t in 0u8..8, flags in 0u8..8, conn: u64, req: u64, region: u64, key: u128,
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
        fn decode_survives_mutation(t in 0u8..8, at in 0usize..72, byte: u8) {
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
