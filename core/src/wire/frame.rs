//! Control-endpoint frames: an 8-byte header (magic "TW", version, kind, payload length) and a
//! payload of at most [`MAX_FRAME`] bytes.

use crate::error::{Error, Result};

/// Magic bytes opening every frame.
pub const MAGIC: [u8; 2] = *b"TW";
/// Current protocol version.
pub const VERSION: u8 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 8;
/// Largest payload.
pub const MAX_FRAME: u32 = 1 << 20;

/// Frame kinds on the control endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameKind {
    /// A descriptor, with the client's proof (sent by both sides of a handshake).
    Hello,
    /// A refusal with a reason (UTF-8).
    Reject,
    /// The client's opening nonce.
    Open,
    /// The server's nonce and proof.
    Challenge,
}

impl FrameKind {
    fn tag(self) -> u8 {
        match self {
            FrameKind::Hello => 1,
            FrameKind::Reject => 2,
            FrameKind::Open => 3,
            FrameKind::Challenge => 4,
        }
    }
    fn from_tag(t: u8) -> Result<Self> {
        Ok(match t {
            1 => FrameKind::Hello,
            2 => FrameKind::Reject,
            3 => FrameKind::Open,
            4 => FrameKind::Challenge,
            _ => return Err(Error::protocol(format!("unknown frame kind {t}"))),
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Kind of frame.
    pub kind: FrameKind,
    /// Payload length (<= [`MAX_FRAME`]).
    pub len: u32,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..2].copy_from_slice(&MAGIC);
        h[2] = VERSION;
        h[3] = self.kind.tag();
        h[4..].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Decodes and validates a header; never panics.
    pub fn decode(h: &[u8]) -> Result<FrameHeader> {
        let h: &[u8; HEADER_LEN] = h.try_into().map_err(|_| {
            Error::protocol(format!("frame header is {} bytes, expected {HEADER_LEN}", h.len()))
        })?;
        if h[..2] != MAGIC {
            return Err(Error::protocol(format!("bad frame magic {:02x}{:02x}", h[0], h[1])));
        }
        if h[2] != VERSION {
            return Err(Error::protocol(format!(
                "frame version {} not supported (this build speaks {VERSION})",
                h[2]
            )));
        }
        let kind = FrameKind::from_tag(h[3])?;
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if len > MAX_FRAME {
            return Err(Error::Capacity {
                what: "control frame".into(),
                requested: len.into(),
                limit: MAX_FRAME.into(),
            });
        }
        Ok(FrameHeader { kind, len })
    }
}

/// Header + payload as one buffer; errors when the payload exceeds [`MAX_FRAME`].
pub fn encode_frame(kind: FrameKind, payload: &[u8]) -> Result<Vec<u8>> {
    let len = u32::try_from(payload.len()).ok().filter(|&l| l <= MAX_FRAME).ok_or_else(|| {
        Error::Capacity {
            what: "control frame".into(),
            requested: payload.len() as u64,
            limit: MAX_FRAME.into(),
        }
    })?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&FrameHeader { kind, len }.encode());
    out.extend_from_slice(payload);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_round_trip_and_rejections() {
        let h = FrameHeader { kind: FrameKind::Hello, len: 1234 };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[2] = 9;
        assert!(FrameHeader::decode(&bad).unwrap_err().to_string().contains("version 9"));
        let mut big = h.encode();
        big[4..].copy_from_slice(&(MAX_FRAME + 1).to_le_bytes());
        assert!(matches!(FrameHeader::decode(&big), Err(Error::Capacity { .. })));
        assert!(FrameHeader::decode(&[0u8; 3]).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            let _ = FrameHeader::decode(&bytes);
        }
    }
}
