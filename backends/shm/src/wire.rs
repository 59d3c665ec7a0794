//! The shm control protocol on the Unix socket between two engines: fixed 56-byte headers, an
//! optional bounded body, and (on a grant) one memfd passed with `SCM_RIGHTS`. Data never crosses
//! the socket; it is copied between the two mappings. A pure codec, total on any input.
//!
//! ```text
//! 0..2 magic "TS"  2 version  3 kind  4 status  5 flags  6..8 zero
//! 8..16 request id  16..24 region  24..40 access key  40..48 offset  48..56 len
//! ```
//! Body that follows: Notify: `len` bytes; Granted or NotifyAck with status Err: `len` bytes of
//! encoded error; nothing otherwise (a Granted ok's `len` is the region length).

use tensorwire_core::wire::envelope::MAX_NOTIFY_BYTES;
use tensorwire_core::wire::error::MAX_ERROR_BYTES;
use tensorwire_core::{AccessKey, Error, RegionId, Result};

/// Header length.
pub const HEADER_LEN: usize = 56;
/// Magic.
pub const MAGIC: [u8; 2] = *b"TS";
/// Protocol version.
pub const VERSION: u8 = 1;
/// Largest notification body (a user payload plus the engine's envelope).
pub const MAX_NOTIFY_WIRE: u64 = MAX_NOTIFY_BYTES as u64 + 1024;

/// Begin: the client wants the region's memfd with the grant.
pub const WANT_FD: u8 = 1;
/// Begin: the op writes the region (else it reads it).
pub const ACCESS_WRITE: u8 = 2;
/// Granted: a memfd accompanies this header.
pub const HAS_FD: u8 = 4;
/// Granted: the memfd may be mapped writable.
pub const WRITABLE: u8 = 8;
const KNOWN_FLAGS: u8 = WANT_FD | ACCESS_WRITE | HAS_FD | WRITABLE;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Client: an op on `[offset, offset+len)` of a region is about to run; hold the region.
    Begin,
    /// Server: go ahead (maybe with the memfd), or the error that refuses the op.
    Granted,
    /// Client: the op's copy is over; release the region.
    End,
    /// Client: a notification.
    Notify,
    /// Server: the notification was delivered, or the error.
    NotifyAck,
    /// Server: a region was deregistered; drop its mapping.
    Forget,
}

impl Kind {
    fn tag(self) -> u8 {
        match self {
            Kind::Begin => 1,
            Kind::Granted => 2,
            Kind::End => 3,
            Kind::Notify => 4,
            Kind::NotifyAck => 5,
            Kind::Forget => 6,
        }
    }
    fn from_tag(t: u8) -> Result<Kind> {
        Ok(match t {
            1 => Kind::Begin,
            2 => Kind::Granted,
            3 => Kind::End,
            4 => Kind::Notify,
            5 => Kind::NotifyAck,
            6 => Kind::Forget,
            _ => return Err(Error::protocol(format!("shm: unknown frame kind {t}"))),
        })
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// False when an encoded error follows (Granted, NotifyAck).
    pub ok: bool,
    /// Flag bits.
    pub flags: u8,
    /// Request id.
    pub req: u64,
    /// Region.
    pub region: RegionId,
    /// Access key.
    pub key: AccessKey,
    /// Offset.
    pub offset: u64,
    /// Length (see the module docs).
    pub len: u64,
}

impl Header {
    /// A header with no region fields.
    pub fn new(kind: Kind, req: u64) -> Header {
        Header {
            kind,
            ok: true,
            flags: 0,
            req,
            region: RegionId(0),
            key: AccessKey::from_bits(0),
            offset: 0,
            len: 0,
        }
    }

    /// Body bytes following the header.
    pub fn body_len(&self) -> u64 {
        match (self.kind, self.ok) {
            (Kind::Notify, _) => self.len,
            (Kind::Granted | Kind::NotifyAck, false) => self.len,
            _ => 0,
        }
    }

    /// Encodes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..2].copy_from_slice(&MAGIC);
        h[2] = VERSION;
        h[3] = self.kind.tag();
        h[4] = u8::from(!self.ok);
        h[5] = self.flags;
        h[8..16].copy_from_slice(&self.req.to_le_bytes());
        h[16..24].copy_from_slice(&self.region.0.to_le_bytes());
        h[24..40].copy_from_slice(&self.key.to_bits().to_le_bytes());
        h[40..48].copy_from_slice(&self.offset.to_le_bytes());
        h[48..56].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Decodes and validates (magic, version, kind, status, flags, body bound). Never panics.
    pub fn decode(h: &[u8]) -> Result<Header> {
        let h: &[u8; HEADER_LEN] = h.try_into().map_err(|_| {
            Error::protocol(format!("shm header is {} bytes, expected {HEADER_LEN}", h.len()))
        })?;
        if h[..2] != MAGIC {
            return Err(Error::protocol(format!("shm: bad magic {:02x}{:02x}", h[0], h[1])));
        }
        if h[2] != VERSION {
            return Err(Error::protocol(format!(
                "shm protocol version {} not supported (this build speaks {VERSION})",
                h[2]
            )));
        }
        let kind = Kind::from_tag(h[3])?;
        let ok = match h[4] {
            0 => true,
            1 if matches!(kind, Kind::Granted | Kind::NotifyAck) => false,
            s => return Err(Error::protocol(format!("shm: bad status {s} on {kind:?}"))),
        };
        if h[5] & !KNOWN_FLAGS != 0 || h[6..8] != [0, 0] {
            return Err(Error::protocol("shm: unknown flags or non-zero reserved bytes"));
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let mut key = [0u8; 16];
        key.copy_from_slice(&h[24..40]);
        let hdr = Header {
            kind,
            ok,
            flags: h[5],
            req: u64_at(8),
            region: RegionId(u64_at(16)),
            key: AccessKey::from_bits(u128::from_le_bytes(key)),
            offset: u64_at(40),
            len: u64_at(48),
        };
        let limit = match kind {
            Kind::Notify => MAX_NOTIFY_WIRE,
            _ => MAX_ERROR_BYTES as u64,
        };
        if hdr.body_len() > limit {
            return Err(Error::Capacity {
                what: format!("shm {kind:?} body"),
                requested: hdr.body_len(),
                limit,
            });
        }
        Ok(hdr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_bounds() {
        let mut h = Header::new(Kind::Begin, 7);
        h.region = RegionId(3);
        h.key = AccessKey::from_bits(0xfeed);
        h.offset = 10;
        h.len = 1 << 30;
        h.flags = WANT_FD | ACCESS_WRITE;
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert_eq!(h.body_len(), 0);
        let mut n = Header::new(Kind::Notify, 1);
        n.len = MAX_NOTIFY_WIRE + 1;
        assert!(matches!(Header::decode(&n.encode()), Err(Error::Capacity { .. })));
        let mut e = Header::new(Kind::Granted, 1);
        e.ok = false;
        e.len = 10;
        assert_eq!(Header::decode(&e.encode()).unwrap().body_len(), 10);
        let mut bad = h.encode();
        bad[4] = 1; // error status on a Begin
        assert!(Header::decode(&bad).is_err());
        bad = h.encode();
        bad[5] = 0x80;
        assert!(Header::decode(&bad).is_err());
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Header::decode(&bytes);
        }

        #[test]
        fn decoded_headers_round_trip(mut bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            bytes[..2].copy_from_slice(&MAGIC);
            bytes[2] = VERSION;
            if let Ok(h) = Header::decode(&bytes) {
                prop_assert!(h.body_len() <= MAX_NOTIFY_WIRE);
                prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
            }
        }
    }
}
