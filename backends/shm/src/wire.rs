//! The shm control protocol on the Unix socket between two engines (every same-host medium
//! speaks it: memfds for shm, CUDA IPC handles for cuda): fixed 56-byte headers, an optional
//! bounded body, and (on a grant) the region's export: up to [`MAX_SHARE_BYTES`] bytes and one
//! descriptor passed with `SCM_RIGHTS`. Data never crosses the socket; it is copied between the
//! two openings of the same memory. A pure codec, total on any input.
//!
//! ```text
//! 0..2 magic "TS"  2 version  3 kind  4 status  5 flags  6..8 share length (else zero)
//! 8..16 request id  16..24 region  24..40 access key  40..48 offset  48..56 len
//! ```
//! Body that follows: Notify: `len` bytes; Granted or NotifyAck with status Err: `len` bytes of
//! encoded error; Granted ok: the export's `share` bytes (its `len` is the region length);
//! nothing otherwise.
//!
//! Leases (version 2): a Begin with [`LEASE`] asks to hold the whole region for this connection.
//! A Granted with [`LEASE`] says it is held until the client's `Released`: the client runs later
//! ops on it (same key and access) without asking, and sends no End for them. When the region is
//! deregistered the server sends `Forget`; the client stops using the lease, waits for its copies
//! in flight, and answers `Released`, which lets the deregistration finish.
//!
//! Live page (version 4): the server's first frame is `Live`, with a descriptor of one sealed
//! memfd page where its shutdown writes "closed" before it hangs up; the client reads it before
//! each op it copies without asking (see `live.rs`).

use tensorwire_core::backend::kit::{Framing, MAX_ERROR_BYTES, MAX_NOTIFY_WIRE, Reader, Writer};
use tensorwire_core::{AccessKey, Error, RegionId, Result, backend::RemoteRange};

pub use crate::medium::MAX_SHARE_BYTES;

/// Header length.
pub const HEADER_LEN: usize = 56;
/// The protocol's magic ("TS"), version and largest body.
pub const FRAMING: Framing =
    Framing { name: "shm", magic: *b"TS", version: 4, max_payload: MAX_NOTIFY_WIRE as u32 };

/// Begin: the client wants the region's export (share bytes, descriptor) with the grant.
pub const WANT_SHARE: u8 = 1;
/// Begin: the op writes the region (else it reads it).
pub const ACCESS_WRITE: u8 = 2;
/// Granted: a descriptor accompanies this header.
pub const HAS_FD: u8 = 4;
/// Granted: the export may be opened writable.
pub const WRITABLE: u8 = 8;
/// Begin: hold the whole region until released; Granted: it is held (a lease).
pub const LEASE: u8 = 16;
const KNOWN_FLAGS: u8 = WANT_SHARE | ACCESS_WRITE | HAS_FD | WRITABLE | LEASE;

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
    /// Server: a region was deregistered; drop its mapping (and release its leases).
    Forget,
    /// Client: its lease on `region` for the access its flags name ([`ACCESS_WRITE`] or not)
    /// is over, and no copy on it is in flight.
    Released,
    /// Server, first frame (with [`HAS_FD`]): the connection's live page.
    Live,
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
            Kind::Released => 7,
            Kind::Live => 8,
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
            7 => Kind::Released,
            8 => Kind::Live,
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
    /// Bytes of the region's export after a Granted ok (zero on every other frame).
    pub share: u16,
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
            share: 0,
        }
    }

    /// The remote bytes a request names.
    pub fn range(&self) -> RemoteRange {
        RemoteRange { region: self.region, key: self.key, offset: self.offset, len: self.len }
    }

    /// Body bytes following the header.
    pub fn body_len(&self) -> u64 {
        match (self.kind, self.ok) {
            (Kind::Notify, _) => self.len,
            (Kind::Granted | Kind::NotifyAck, false) => self.len,
            (Kind::Granted, true) => u64::from(self.share),
            _ => 0,
        }
    }

    /// Encodes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut w = Writer::new();
        w.raw(&FRAMING.magic).u8(FRAMING.version).u8(self.kind.tag());
        w.u8(u8::from(!self.ok)).u8(self.flags).u16(self.share);
        w.u64(self.req).u64(self.region.0).u128(self.key.to_bits()).u64(self.offset).u64(self.len);
        w.finish_fixed()
    }

    /// Decodes and validates (magic, version, kind, status, flags, body bound). Never panics.
    pub fn decode(h: &[u8]) -> Result<Header> {
        if h.len() != HEADER_LEN {
            return Err(Error::protocol(format!(
                "shm header is {} bytes, expected {HEADER_LEN}",
                h.len()
            )));
        }
        let mut r = Reader::new(h, "shm header");
        FRAMING.check_prefix(r.raw(3)?)?;
        let kind = Kind::from_tag(r.u8()?)?;
        let ok = match r.u8()? {
            0 => true,
            1 if matches!(kind, Kind::Granted | Kind::NotifyAck) => false,
            s => return Err(Error::protocol(format!("shm: bad status {s} on {kind:?}"))),
        };
        let (flags, share) = (r.u8()?, r.u16()?);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(Error::protocol("shm: unknown flags"));
        }
        if share != 0 && !(kind == Kind::Granted && ok) {
            return Err(Error::protocol(format!("shm: share bytes on a {kind:?}")));
        }
        if usize::from(share) > MAX_SHARE_BYTES {
            return Err(Error::protocol(format!("shm: a {share}-byte share")));
        }
        let hdr = Header {
            kind,
            ok,
            flags,
            req: r.u64()?,
            region: RegionId(r.u64()?),
            key: AccessKey::from_bits(r.u128()?),
            offset: r.u64()?,
            len: r.u64()?,
            share,
        };
        let limit = match (kind, ok) {
            (Kind::Notify, _) => MAX_NOTIFY_WIRE,
            (Kind::Granted, true) => MAX_SHARE_BYTES,
            _ => MAX_ERROR_BYTES,
        };
        FRAMING.check_len(&format!("{kind:?} body"), hdr.body_len(), limit as u64)?;
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
        h.flags = WANT_SHARE | ACCESS_WRITE;
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert_eq!(h.body_len(), 0);
        let mut n = Header::new(Kind::Notify, 1);
        n.len = MAX_NOTIFY_WIRE as u64 + 1;
        assert!(matches!(Header::decode(&n.encode()), Err(Error::Capacity { .. })));
        let mut e = Header::new(Kind::Granted, 1);
        e.ok = false;
        e.len = 10;
        assert_eq!(Header::decode(&e.encode()).unwrap().body_len(), 10);
        let mut g = Header::new(Kind::Granted, 2);
        g.share = 100;
        assert_eq!(Header::decode(&g.encode()).unwrap().body_len(), 100);
        g.share = MAX_SHARE_BYTES as u16 + 1;
        assert!(Header::decode(&g.encode()).is_err(), "an oversized share");
        let mut s = h;
        s.share = 1;
        assert!(Header::decode(&s.encode()).is_err(), "share bytes on a Begin");
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
            bytes[..2].copy_from_slice(&FRAMING.magic);
            bytes[2] = FRAMING.version;
            if let Ok(h) = Header::decode(&bytes) {
                prop_assert!(h.body_len() <= MAX_NOTIFY_WIRE as u64);
                prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
            }
        }
    }
}
