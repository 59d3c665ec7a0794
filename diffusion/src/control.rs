//! Connector control messages, carried in engine notifications: a consumer subscribes to a chunked
//! p2p payload (holding it for a while: see [`Control::Subscribe`]), the producer announces each
//! chunk as it becomes ready (with its crc32c when checksums are on), the consumer says when it is
//! done (counting as a consumer or not), and a producer that cannot serve says why. The
//! producer's verdict on `Done` (what the consumer's `notify` returns) says whether it still
//! served the payload when `Done` arrived. Versioned and total.

use tensorwire_core::{Error, Result};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_proto::wire::frame::Framing;

use crate::error::{ConnectorError, LeaseEnd};

/// The longest hold a subscription may ask for (a consumer asks for less; a producer caps a
/// longer ask to this).
pub const MAX_HOLD: std::time::Duration = std::time::Duration::from_secs(600);

/// The messages' magic ("TC") and version.
pub const FRAMING: Framing =
    Framing { name: "connector control", magic: *b"TC", version: 3, max_payload: 64 };

/// Why a producer cannot serve a payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// It does not hold the payload (never published, or already released).
    NotPublished,
    /// Every expected consumer already consumed it.
    Consumed,
    /// Its lease expired.
    Expired,
    /// The producer retired it.
    Retired,
    /// The producer dropped its publication before every chunk was ready.
    Abandoned,
}

impl Gone {
    /// Every reason, in wire-tag order.
    pub const ALL: [Gone; 5] =
        [Gone::NotPublished, Gone::Consumed, Gone::Expired, Gone::Retired, Gone::Abandoned];

    /// The error a consumer of `payload` sees.
    pub fn error(self, payload: u64) -> ConnectorError {
        let p = payload.to_string();
        match self {
            Gone::NotPublished => ConnectorError::Missing {
                payload: p,
                why: "its producer does not hold it (never published, or already released)".into(),
            },
            Gone::Consumed => ConnectorError::LeaseEnded { payload: p, end: LeaseEnd::Consumed },
            Gone::Expired => ConnectorError::LeaseEnded { payload: p, end: LeaseEnd::Expired },
            Gone::Retired => {
                ConnectorError::ProducerGone(format!("payload {p} retired by its producer"))
            }
            Gone::Abandoned => {
                ConnectorError::ProducerGone(format!("payload {p} abandoned by its producer"))
            }
        }
    }
}

/// A control message about one payload of the producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Consumer -> producer: send me chunk announcements for `payload`, and keep its buffer
    /// (even past the end of its lease) until I say `Done`, or `hold_ms`
    /// pass. A consumer may start reading before this arrives: a payload still held when it
    /// arrives was held all along, and the hold keeps it for the reads after.
    Subscribe {
        /// The payload.
        payload: u64,
        /// How long the producer keeps the buffer for this consumer, at most [`MAX_HOLD`].
        hold_ms: u32,
    },
    /// Producer -> consumer: chunk `index` of `payload` is ready.
    Ready {
        /// The payload.
        payload: u64,
        /// The chunk.
        index: u32,
        /// Its crc32c, with checksums on.
        crc: Option<u32>,
    },
    /// Consumer -> producer: done reading `payload` (sent after the reads, so a payload still
    /// served when it arrives was served throughout them); ends the consumer's hold, and with
    /// `consumed` counts it as a consumer of the lease.
    Done {
        /// The payload.
        payload: u64,
        /// Whether it counts as a consumer.
        consumed: bool,
    },
    /// Producer -> consumer: `payload` cannot be served.
    Gone {
        /// The payload.
        payload: u64,
        /// Why.
        why: Gone,
    },
}

impl Control {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(&FRAMING.magic).u8(FRAMING.version);
        match self {
            Control::Subscribe { payload, hold_ms } => w.u8(1).u64(*payload).u32(*hold_ms),
            Control::Ready { payload, index, crc } => {
                w.u8(2).u64(*payload).u32(*index).opt(*crc, |w, c| {
                    w.u32(c);
                })
            }
            Control::Done { payload, consumed } => w.u8(3).u64(*payload).bool(*consumed),
            Control::Gone { payload, why } => {
                let tag = Gone::ALL.iter().position(|g| g == why).unwrap_or(0);
                w.u8(4).u64(*payload).u8(tag as u8)
            }
        };
        w.finish()
    }

    /// Decodes; `Ok(None)` for a notification that is not a connector message.
    pub fn decode(b: &[u8]) -> Result<Option<Control>> {
        if b.get(..2) != Some(&FRAMING.magic[..]) {
            return Ok(None);
        }
        let mut r = Reader::new(b, "connector control");
        FRAMING.check_prefix(r.raw(3)?)?;
        let c = match r.u8()? {
            1 => Control::Subscribe { payload: r.u64()?, hold_ms: r.u32()? },
            2 => Control::Ready {
                payload: r.u64()?,
                index: r.u32()?,
                crc: r.opt("crc", Reader::u32)?,
            },
            3 => Control::Done { payload: r.u64()?, consumed: r.bool("consumed")? },
            4 => {
                let payload = r.u64()?;
                let t = r.u8()?;
                let why = *Gone::ALL.get(usize::from(t)).ok_or_else(|| {
                    Error::protocol(format!("connector control: unknown reason {t}"))
                })?;
                Control::Gone { payload, why }
            }
            t => return Err(Error::protocol(format!("connector control: unknown kind {t}"))),
        };
        r.finish()?;
        Ok(Some(c))
    }
}
