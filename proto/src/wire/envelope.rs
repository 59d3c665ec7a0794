//! The envelope around every notification an engine sends: the sender's engine id and what the message
//! is (a user message, or the chunk API's landed / aborted signals).

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::ids::EngineId;
use crate::wire::codec::{Reader, Writer};

/// Envelope version.
pub const ENVELOPE_VERSION: u8 = 1;
/// Largest user notification payload.
pub const MAX_NOTIFY_BYTES: usize = 64 << 10;
/// Largest encoded envelope: what a backend's `notify` must be able to carry.
pub const MAX_NOTIFY_WIRE: usize = MAX_NOTIFY_BYTES + 1024;
/// Longest abort reason.
const MAX_REASON: usize = 1024;

/// What a notification carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A user message.
    User(Bytes),
    /// Chunk `index` of chunked transfer `transfer` has landed in the receiver's memory.
    ChunkLanded {
        /// Transfer id (chosen by the receiver).
        transfer: u64,
        /// Chunk index.
        index: u32,
    },
    /// The producer gave up on a chunked transfer.
    ChunkAbort {
        /// Transfer id.
        transfer: u64,
        /// Why.
        reason: String,
    },
}

/// A message and its sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// Sending engine.
    pub from: EngineId,
    /// Content.
    pub msg: Message,
}

impl Envelope {
    /// Encodes; a user payload over [`MAX_NOTIFY_BYTES`] is [`Error::Capacity`].
    pub fn encode(&self) -> Result<Bytes> {
        let mut w = Writer::new();
        w.u8(ENVELOPE_VERSION);
        match &self.msg {
            Message::User(p) => {
                if p.len() > MAX_NOTIFY_BYTES {
                    return Err(Error::Capacity {
                        what: "notification payload".into(),
                        requested: p.len() as u64,
                        limit: MAX_NOTIFY_BYTES as u64,
                    });
                }
                w.u8(0).u128(self.from.0).raw(p);
            }
            Message::ChunkLanded { transfer, index } => {
                w.u8(1).u128(self.from.0).u64(*transfer).u32(*index);
            }
            Message::ChunkAbort { transfer, reason } => {
                let cut = floor_char_boundary(reason, MAX_REASON);
                w.u8(2).u128(self.from.0).u64(*transfer).str(&reason[..cut]);
            }
        }
        Ok(Bytes::from(w.finish()))
    }

    /// Decodes; never panics.
    pub fn decode(buf: &[u8]) -> Result<Envelope> {
        let mut r = Reader::new(buf, "notification");
        let v = r.u8()?;
        if v != ENVELOPE_VERSION {
            return Err(Error::protocol(format!("notification version {v} not supported")));
        }
        let kind = r.u8()?;
        let from = EngineId(r.u128()?);
        let msg = match kind {
            0 => {
                let rest = r.rest();
                if rest.len() > MAX_NOTIFY_BYTES {
                    return Err(Error::protocol(format!(
                        "notification payload {} bytes exceeds {MAX_NOTIFY_BYTES}",
                        rest.len()
                    )));
                }
                Message::User(Bytes::copy_from_slice(rest))
            }
            1 => Message::ChunkLanded { transfer: r.u64()?, index: r.u32()? },
            2 => Message::ChunkAbort { transfer: r.u64()?, reason: r.str(MAX_REASON, "reason")? },
            k => return Err(Error::protocol(format!("unknown notification kind {k}"))),
        };
        r.finish()?;
        Ok(Envelope { from, msg })
    }
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    (0..=max).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips() {
        for msg in [
            Message::User(Bytes::from_static(b"hello")),
            Message::ChunkLanded { transfer: 5, index: 3 },
            Message::ChunkAbort { transfer: 5, reason: "producer died".into() },
        ] {
            let e = Envelope { from: EngineId(42), msg };
            assert_eq!(Envelope::decode(&e.encode().unwrap()).unwrap(), e);
        }
    }

    #[test]
    fn oversized_user_payload_is_refused() {
        let e = Envelope {
            from: EngineId(1),
            msg: Message::User(Bytes::from(vec![0u8; MAX_NOTIFY_BYTES + 1])),
        };
        assert!(matches!(e.encode(), Err(Error::Capacity { .. })));
    }

    #[test]
    fn long_reason_is_cut_on_a_char_boundary() {
        let e = Envelope {
            from: EngineId(1),
            msg: Message::ChunkAbort { transfer: 1, reason: "é".repeat(1000) },
        };
        let d = Envelope::decode(&e.encode().unwrap()).unwrap();
        match d.msg {
            Message::ChunkAbort { reason, .. } => assert!(reason.len() <= MAX_REASON),
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Envelope::decode(&bytes);
        }
    }
}
