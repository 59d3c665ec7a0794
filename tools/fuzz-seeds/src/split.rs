//! Cutting recorded byte streams back into the messages they carried.

use tensorwire_proto::wire::frame::{Framing, HEADER_LEN};
use tensorwire_tcp::wire::{self as tcp, DataHeader};

/// One frame of a framed protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its kind.
    pub kind: u8,
    /// Header and payload, as sent.
    pub whole: Vec<u8>,
}

impl Frame {
    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.whole[HEADER_LEN..]
    }
}

/// The frames of `stream`, in order, up to the first incomplete or malformed one.
pub fn frames(stream: &[u8], framing: &Framing) -> Vec<Frame> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(h) = stream.get(at..at + HEADER_LEN) {
        let Ok(header) = framing.decode_header(h) else { break };
        let end = at + HEADER_LEN + header.len as usize;
        let Some(whole) = stream.get(at..end) else { break };
        out.push(Frame { kind: header.kind, whole: whole.to_vec() });
        at = end;
    }
    out
}

/// One frame of the tcp backend's data protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataFrame {
    /// The header's bytes.
    pub header: Vec<u8>,
    /// It, decoded.
    pub decoded: DataHeader,
    /// The payload that followed it.
    pub payload: Vec<u8>,
}

/// The frames of one direction of a tcp data stream (after its `opening`: the preamble, and
/// from the client the ticket too), in order, up to the first incomplete or malformed one.
pub fn data_frames(stream: &[u8], opening: usize) -> Vec<DataFrame> {
    let mut out = Vec::new();
    let mut at = opening;
    while let Some(h) = stream.get(at..at + tcp::HEADER_LEN) {
        let Ok(decoded) = DataHeader::decode(h) else { break };
        let end = at + tcp::HEADER_LEN + decoded.payload_len() as usize;
        let Some(payload) = stream.get(at + tcp::HEADER_LEN..end) else { break };
        out.push(DataFrame { header: h.to_vec(), decoded, payload: payload.to_vec() });
        at = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_proto::wire::frame::CONTROL;

    #[test]
    fn frames_stop_at_a_partial_frame() {
        let mut s = CONTROL.encode(1, b"abc").unwrap();
        s.extend(CONTROL.encode(2, b"").unwrap());
        let partial = CONTROL.encode(3, b"xyz").unwrap();
        s.extend(&partial[..partial.len() - 1]);
        let f = frames(&s, &CONTROL);
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].kind, f[0].payload()), (1, &b"abc"[..]));
        assert_eq!((f[1].kind, f[1].payload()), (2, &b""[..]));
    }
}
