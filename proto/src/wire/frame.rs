//! The one framing of tensorwire's byte streams. A protocol is a [`Framing`] (name, 2-byte magic,
//! version, payload bound); its frames are an 8-byte header (magic, version, kind, payload length)
//! and a payload of at most `max_payload` bytes. The engine control endpoint, the store RPC and
//! the orchestrator service frame their messages with it; backends' fixed-size data headers reuse
//! its prefix and length checks ([`Framing::check_prefix`], [`Framing::check_len`]).
//!
//! Kinds [`RESERVED_KINDS`] and above belong to the authenticated handshake every framed protocol
//! opens with (`crate::handshake`).

use crate::error::{Error, Result};

/// Header length in bytes.
pub const HEADER_LEN: usize = 8;
/// Frame kinds from here up are the handshake's.
pub const RESERVED_KINDS: u8 = 0xf0;

/// A protocol's framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    /// Name in errors ("control", "store rpc").
    pub name: &'static str,
    /// Magic bytes opening every header.
    pub magic: [u8; 2],
    /// Protocol version.
    pub version: u8,
    /// Largest payload.
    pub max_payload: u32,
}

/// The engine control endpoint's framing.
pub const CONTROL: Framing =
    Framing { name: "control", magic: *b"TW", version: 2, max_payload: 1 << 20 };

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Kind of frame (protocol-defined below [`RESERVED_KINDS`]).
    pub kind: u8,
    /// Payload length (at most the framing's `max_payload`).
    pub len: u32,
}

impl Framing {
    /// Checks the first three bytes of a header: this protocol's magic and version. Never panics.
    pub fn check_prefix(&self, h: &[u8]) -> Result<()> {
        let [a, b, v, ..] = *h else {
            return Err(Error::protocol(format!("{}: header of {} bytes", self.name, h.len())));
        };
        if [a, b] != self.magic {
            return Err(Error::protocol(format!("{}: bad magic {a:02x}{b:02x}", self.name)));
        }
        if v != self.version {
            return Err(Error::protocol(format!(
                "{} version {v} not supported (this build speaks {})",
                self.name, self.version
            )));
        }
        Ok(())
    }

    /// Checks a length field against its bound: [`Error::Capacity`] naming the protocol and `what`.
    pub fn check_len(&self, what: &str, len: u64, limit: u64) -> Result<()> {
        if len > limit {
            return Err(Error::Capacity {
                what: format!("{} {what}", self.name),
                requested: len,
                limit,
            });
        }
        Ok(())
    }

    /// Encodes a header.
    pub fn header(&self, h: FrameHeader) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..2].copy_from_slice(&self.magic);
        b[2] = self.version;
        b[3] = h.kind;
        b[4..].copy_from_slice(&h.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header; never panics.
    pub fn decode_header(&self, h: &[u8]) -> Result<FrameHeader> {
        let h: &[u8; HEADER_LEN] = h.try_into().map_err(|_| {
            Error::protocol(format!(
                "{}: header is {} bytes, expected {HEADER_LEN}",
                self.name,
                h.len()
            ))
        })?;
        self.check_prefix(h)?;
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        self.check_len("frame", len.into(), self.max_payload.into())?;
        Ok(FrameHeader { kind: h[3], len })
    }

    /// Header + payload as one buffer; [`Error::Capacity`] when the payload is too large.
    pub fn encode(&self, kind: u8, payload: &[u8]) -> Result<Vec<u8>> {
        self.check_len("frame", payload.len() as u64, self.max_payload.into())?;
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(&self.header(FrameHeader { kind, len: payload.len() as u32 }));
        out.extend_from_slice(payload);
        Ok(out)
    }

    /// Splits one whole frame (header + payload, nothing after) into its kind and payload.
    pub fn decode<'a>(&self, frame: &'a [u8]) -> Result<(u8, &'a [u8])> {
        let (h, payload) = frame.split_at_checked(HEADER_LEN).ok_or_else(|| {
            Error::protocol(format!("{}: frame of {} bytes", self.name, frame.len()))
        })?;
        let h = self.decode_header(h)?;
        if payload.len() != h.len as usize {
            return Err(Error::protocol(format!(
                "{}: header says {} payload bytes, frame has {}",
                self.name,
                h.len,
                payload.len()
            )));
        }
        Ok((h.kind, payload))
    }

    /// Reads one frame; `Ok(None)` at a clean end of stream before a header. The payload buffer
    /// is allocated only after the header was checked against the bound.
    #[cfg(not(loom))]
    pub async fn read<R>(&self, r: &mut R) -> Result<Option<(u8, Vec<u8>)>>
    where
        R: tokio::io::AsyncRead + Unpin + ?Sized,
    {
        use tokio::io::AsyncReadExt;
        let mut h = [0u8; HEADER_LEN];
        match r.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let h = self.decode_header(&h)?;
        let mut payload = vec![0u8; h.len as usize];
        r.read_exact(&mut payload).await?;
        Ok(Some((h.kind, payload)))
    }

    /// Writes one frame.
    #[cfg(not(loom))]
    pub async fn write<W>(&self, w: &mut W, kind: u8, payload: &[u8]) -> Result<()>
    where
        W: tokio::io::AsyncWrite + Unpin + ?Sized,
    {
        use tokio::io::AsyncWriteExt;
        w.write_all(&self.encode(kind, payload)?).await?;
        w.flush().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_round_trip_and_rejections() {
        let h = FrameHeader { kind: 1, len: 1234 };
        assert_eq!(CONTROL.decode_header(&CONTROL.header(h)).unwrap(), h);
        let mut bad = CONTROL.header(h);
        bad[2] = 9;
        assert!(CONTROL.decode_header(&bad).unwrap_err().to_string().contains("version 9"));
        let mut big = CONTROL.header(h);
        big[4..].copy_from_slice(&(CONTROL.max_payload + 1).to_le_bytes());
        assert!(matches!(CONTROL.decode_header(&big), Err(Error::Capacity { .. })));
        assert!(CONTROL.decode_header(&[0u8; 3]).is_err());
        let other = Framing { magic: *b"XX", ..CONTROL };
        assert!(other.decode_header(&CONTROL.header(h)).unwrap_err().to_string().contains("magic"));
        assert!(CONTROL.check_prefix(b"TW").is_err(), "a short prefix is an error, not a panic");
    }

    #[test]
    fn whole_frames_split_exactly() {
        let f = CONTROL.encode(3, b"abc").unwrap();
        assert_eq!(CONTROL.decode(&f).unwrap(), (3, &b"abc"[..]));
        assert!(CONTROL.decode(&f[..f.len() - 1]).is_err(), "truncated");
        let mut long = f.clone();
        long.push(0);
        assert!(CONTROL.decode(&long).is_err(), "trailing byte");
        let small = Framing { max_payload: 2, ..CONTROL };
        assert!(matches!(small.encode(1, b"abc"), Err(Error::Capacity { .. })));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            let _ = CONTROL.decode_header(&bytes);
            let _ = CONTROL.decode(&bytes);
            let _ = CONTROL.check_prefix(&bytes);
        }
    }
}
