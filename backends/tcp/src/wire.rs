//! The TCP data protocol: a preamble each side sends once per stream (the client's followed by
//! the server's [`Ticket`]), then fixed 64-byte headers, each followed by the payload its kind
//! and status say. A pure codec: `DataHeader::decode` is total
//! and bounds every length before a byte of payload is read.
//!
//! ```text
//! 0..2 magic "TD"   2 version   3 kind   4 status   5 flags   6..8 zero
//! 8..16 request id  16..24 region  24..40 access key  40..48 offset  48..56 len
//! 56..60 crc32c     60..64 notice length (ReadReq; zero otherwise)
//! ```
//! `len` is the op's byte count. Payload that follows: WriteReq: `len` bytes; ReadReq: its notice
//! (an engine notification the server delivers before serving the READ, whose refusal fails the
//! READ); ReadResp (ok): `len` bytes; Notify: `len` bytes; any response with status Err: `len`
//! bytes of encoded error; nothing otherwise. Version 2 added the READ's notice; version 3 the
//! ticket after the client's preamble.

use tensorwire_core::backend::kit::{Framing, MAX_ERROR_BYTES, MAX_NOTIFY_WIRE, Reader, Writer};
use tensorwire_core::{AccessKey, Error, RegionId, Result, backend::RemoteRange};

/// Header length.
pub const HEADER_LEN: usize = 64;
/// Largest single WRITE or READ piece on the wire; larger ops are split by the sender.
pub const MAX_PIECE: u64 = 16 << 20;
/// The data protocol's magic ("TD"), version and largest payload.
pub const FRAMING: Framing =
    Framing { name: "tcp data", magic: *b"TD", version: 3, max_payload: MAX_PIECE as u32 };
/// Preamble each side sends first on a new stream.
pub const PREAMBLE: [u8; 8] = [b'T', b'W', b'D', b'A', b'T', b'A', FRAMING.version, 0];

/// Bytes of a [`Ticket`].
pub const TICKET_LEN: usize = 16;

/// What a client sends after its preamble to show it learned the server's endpoint in an
/// engine handshake: random per backend, shown to peers only in the backend's endpoint blob
/// (which travels in the engine's descriptor, so only to a peer that passed the handshake). A
/// stream without it holds nothing for long (see the backend's docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Ticket(pub [u8; TICKET_LEN]);

impl Ticket {
    /// A fresh random ticket.
    pub fn random() -> Ticket {
        let n = tensorwire_proto::auth::nonce();
        let mut t = [0u8; TICKET_LEN];
        t.copy_from_slice(&n[..TICKET_LEN]);
        Ticket(t)
    }

    /// Whether `other` is this ticket, compared in constant time.
    pub fn matches(&self, other: &[u8; TICKET_LEN]) -> bool {
        self.0.iter().zip(other).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticket(..)")
    }
}

/// Flag: the header's crc32c covers the piece's bytes.
pub const FLAG_CRC: u8 = 1;

/// Kinds of data frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Client -> server: bytes for a region.
    WriteReq,
    /// Server -> client: the bytes of a WriteReq are in place (or an error).
    WriteAck,
    /// Client -> server: send me bytes of a region.
    ReadReq,
    /// Server -> client: the bytes (or an error).
    ReadResp,
    /// Client -> server: a notification for the engine.
    Notify,
    /// Server -> client: the notification was delivered (or an error).
    NotifyAck,
}

impl Kind {
    fn tag(self) -> u8 {
        match self {
            Kind::WriteReq => 1,
            Kind::WriteAck => 2,
            Kind::ReadReq => 3,
            Kind::ReadResp => 4,
            Kind::Notify => 5,
            Kind::NotifyAck => 6,
        }
    }
    fn from_tag(t: u8) -> Result<Kind> {
        Ok(match t {
            1 => Kind::WriteReq,
            2 => Kind::WriteAck,
            3 => Kind::ReadReq,
            4 => Kind::ReadResp,
            5 => Kind::Notify,
            6 => Kind::NotifyAck,
            _ => return Err(Error::protocol(format!("tcp data: unknown frame kind {t}"))),
        })
    }
    /// Whether the server sends this kind.
    pub fn is_response(self) -> bool {
        matches!(self, Kind::WriteAck | Kind::ReadResp | Kind::NotifyAck)
    }
}

/// A data frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// Frame kind.
    pub kind: Kind,
    /// Responses only: false when an encoded error follows.
    pub ok: bool,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// Request id, echoed by the response.
    pub id: u64,
    /// Target region (requests).
    pub region: RegionId,
    /// Access key (requests).
    pub key: AccessKey,
    /// Offset in the region (requests).
    pub offset: u64,
    /// Byte count (see the module docs).
    pub len: u64,
    /// Bytes of notice that follow a ReadReq (zero on every other kind).
    pub notice: u32,
    /// crc32c of the piece when `flags & FLAG_CRC`.
    pub crc: u32,
}

impl DataHeader {
    /// A request header.
    pub fn request(
        kind: Kind,
        id: u64,
        region: RegionId,
        key: AccessKey,
        offset: u64,
        len: u64,
    ) -> Self {
        DataHeader { kind, ok: true, flags: 0, id, region, key, offset, len, notice: 0, crc: 0 }
    }

    /// The remote bytes a request names.
    pub fn range(&self) -> RemoteRange {
        RemoteRange { region: self.region, key: self.key, offset: self.offset, len: self.len }
    }

    /// A response header (`len` = payload length).
    pub fn response(kind: Kind, id: u64, ok: bool, len: u64) -> Self {
        DataHeader {
            kind,
            ok,
            flags: 0,
            id,
            region: RegionId(0),
            key: AccessKey::from_bits(0),
            offset: 0,
            len,
            notice: 0,
            crc: 0,
        }
    }

    /// A READ request followed by `len` bytes of notice.
    pub fn with_notice(mut self, len: u32) -> Self {
        self.notice = len;
        self
    }

    /// With a checksum.
    pub fn with_crc(mut self, crc: u32) -> Self {
        self.flags |= FLAG_CRC;
        self.crc = crc;
        self
    }

    /// The checksum, if the header carries one.
    pub fn crc(&self) -> Option<u32> {
        (self.flags & FLAG_CRC != 0).then_some(self.crc)
    }

    /// Bytes of payload following this header on the stream.
    pub fn payload_len(&self) -> u64 {
        match (self.kind, self.ok) {
            (Kind::ReadReq, _) => u64::from(self.notice),
            (Kind::WriteAck | Kind::NotifyAck, true) => 0,
            _ => self.len,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut w = Writer::new();
        w.raw(&FRAMING.magic).u8(FRAMING.version).u8(self.kind.tag());
        w.u8(u8::from(!self.ok)).u8(self.flags).u16(0);
        w.u64(self.id).u64(self.region.0).u128(self.key.to_bits()).u64(self.offset).u64(self.len);
        w.u32(self.crc).u32(self.notice);
        w.finish_fixed()
    }

    /// Decodes and validates a header: magic, version, kind, status, flags, and the payload bound of
    /// its kind. Never panics.
    pub fn decode(h: &[u8]) -> Result<DataHeader> {
        if h.len() != HEADER_LEN {
            return Err(Error::protocol(format!(
                "tcp data header is {} bytes, expected {HEADER_LEN}",
                h.len()
            )));
        }
        let mut r = Reader::new(h, "tcp data header");
        FRAMING.check_prefix(r.raw(3)?)?;
        let kind = Kind::from_tag(r.u8()?)?;
        let ok = match r.u8()? {
            0 => true,
            1 if kind.is_response() => false,
            s => return Err(Error::protocol(format!("tcp data: bad status {s} on {kind:?}"))),
        };
        let (flags, reserved) = (r.u8()?, r.u16()?);
        let hdr = DataHeader {
            kind,
            ok,
            flags,
            id: r.u64()?,
            region: RegionId(r.u64()?),
            key: AccessKey::from_bits(r.u128()?),
            offset: r.u64()?,
            len: r.u64()?,
            crc: r.u32()?,
            notice: r.u32()?,
        };
        if flags & !FLAG_CRC != 0 || reserved != 0 {
            return Err(Error::protocol("tcp data: unknown flags or non-zero reserved bytes"));
        }
        match hdr.kind {
            Kind::ReadReq => {
                let n = u64::from(hdr.notice);
                FRAMING.check_len("READ notice length", n, MAX_NOTIFY_WIRE as u64)?;
            }
            _ if hdr.notice != 0 => {
                return Err(Error::protocol(format!("tcp data: a notice on a {kind:?}")));
            }
            _ => {}
        }
        let limit = match (kind, ok) {
            (_, false) => MAX_ERROR_BYTES as u64,
            (Kind::Notify, _) => MAX_NOTIFY_WIRE as u64,
            (Kind::WriteAck | Kind::NotifyAck, true) => return Ok(hdr), // `len` echoes the op
            _ => MAX_PIECE,
        };
        FRAMING.check_len(&format!("{kind:?} length"), hdr.len, limit)?;
        Ok(hdr)
    }
}

/// Checks a peer's preamble.
pub fn check_preamble(p: &[u8; 8]) -> Result<()> {
    if p[..6] != PREAMBLE[..6] {
        return Err(Error::protocol("tcp data: peer did not send the tensorwire data preamble"));
    }
    if p[6] != FRAMING.version {
        return Err(Error::protocol(format!(
            "tcp data: peer speaks data protocol version {}, this build speaks {}",
            p[6], FRAMING.version
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_bounds() {
        let key = AccessKey::from_bits(0x0707);
        let h =
            DataHeader::request(Kind::WriteReq, 9, RegionId(3), key, 100, 4096).with_crc(0xdead);
        let d = DataHeader::decode(&h.encode()).unwrap();
        assert_eq!(d, h);
        assert_eq!(d.crc(), Some(0xdead));
        assert_eq!(d.payload_len(), 4096);
        let r = DataHeader::request(Kind::ReadReq, 1, RegionId(3), key, 0, MAX_PIECE);
        assert_eq!(DataHeader::decode(&r.encode()).unwrap().payload_len(), 0);
        let big = DataHeader::request(Kind::WriteReq, 1, RegionId(3), key, 0, MAX_PIECE + 1);
        assert!(matches!(DataHeader::decode(&big.encode()), Err(Error::Capacity { .. })));
        let n = DataHeader::request(Kind::Notify, 1, RegionId(0), key, 0, 1 << 20);
        assert!(matches!(DataHeader::decode(&n.encode()), Err(Error::Capacity { .. })));
        let e = DataHeader::response(Kind::WriteAck, 1, false, 10);
        assert_eq!(DataHeader::decode(&e.encode()).unwrap().payload_len(), 10);
        let mut bad = h.encode();
        bad[4] = 1; // error status on a request
        assert!(DataHeader::decode(&bad).is_err());
        let mut v = h.encode();
        v[2] = FRAMING.version + 1;
        let other = format!("version {}", FRAMING.version + 1);
        assert!(DataHeader::decode(&v).unwrap_err().to_string().contains(&other));
        // A READ's notice: its length is the payload that follows, bounded; no other kind has one.
        let n = MAX_NOTIFY_WIRE as u32;
        let r = DataHeader::request(Kind::ReadReq, 2, RegionId(3), key, 0, 4096).with_notice(n);
        assert_eq!(DataHeader::decode(&r.encode()).unwrap(), r);
        assert_eq!(r.payload_len(), u64::from(n));
        let long = r.with_notice(n + 1);
        assert!(matches!(DataHeader::decode(&long.encode()), Err(Error::Capacity { .. })));
        let w = DataHeader::request(Kind::WriteReq, 2, RegionId(3), key, 0, 16).with_notice(1);
        assert!(DataHeader::decode(&w.encode()).unwrap_err().to_string().contains("notice"));
        assert!(check_preamble(&PREAMBLE).is_ok());
        assert!(check_preamble(b"GET / HT").is_err());
        let t = Ticket::random();
        assert!(t.matches(&t.0) && t != Ticket::random());
        let mut near = t.0;
        near[TICKET_LEN - 1] ^= 1;
        assert!(!t.matches(&near));
        assert_eq!(format!("{t:?}"), "Ticket(..)");
    }

    #[test]
    fn each_bound_of_a_header_is_checked_on_its_own() {
        let key = AccessKey::from_bits(7);
        let h = DataHeader::request(Kind::WriteReq, 1, RegionId(3), key, 0, 64);
        // An unknown flag with zeroed reserved bytes, and reserved bytes with known flags.
        let mut flag = h.encode();
        flag[5] = 0x80;
        assert!(DataHeader::decode(&flag).unwrap_err().to_string().contains("flags"));
        let mut reserved = h.with_crc(1).encode();
        reserved[6] = 1;
        assert!(DataHeader::decode(&reserved).unwrap_err().to_string().contains("reserved"));
        // An error response carries at most an encoded error, whatever its kind.
        let err = DataHeader::response(Kind::ReadResp, 1, false, MAX_ERROR_BYTES as u64 + 1);
        assert!(matches!(DataHeader::decode(&err.encode()), Err(Error::Capacity { .. })));
        // An ack echoes its op's length, which may be far more than a piece: no payload follows.
        for kind in [Kind::WriteAck, Kind::NotifyAck] {
            let ack = DataHeader::response(kind, 1, true, 1 << 40);
            assert_eq!(DataHeader::decode(&ack.encode()).unwrap().payload_len(), 0, "{kind:?}");
        }
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = DataHeader::decode(&bytes);
        }

        #[test]
        fn decoded_headers_respect_bounds(mut bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            bytes[..2].copy_from_slice(&FRAMING.magic);
            bytes[2] = FRAMING.version;
            if let Ok(h) = DataHeader::decode(&bytes) {
                prop_assert!(h.payload_len() <= MAX_PIECE);
                prop_assert!(h.kind == Kind::ReadReq || h.notice == 0);
                prop_assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
            }
        }
    }
}
