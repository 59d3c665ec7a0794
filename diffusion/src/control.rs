//! Connector control messages, carried in engine notifications (ordered after the data they
//! follow): a consumer subscribes to a p2p payload, the producer announces each chunk as it becomes
//! ready (with its crc32c when checksums are on), the consumer reports when it is done, and a
//! producer that cannot serve says why. Versioned and total.

use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::wire::frame::Framing;
use tensorwire_core::{Error, Result};

use crate::error::{ConnectorError, LeaseEnd};

/// The messages' magic ("TC") and version.
pub const FRAMING: Framing =
    Framing { name: "connector control", magic: *b"TC", version: 2, max_payload: 64 };

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
    /// Consumer -> producer: send me chunk announcements for `payload`.
    Subscribe {
        /// The payload.
        payload: u64,
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
    /// Consumer -> producer: done with `payload`.
    Consumed {
        /// The payload.
        payload: u64,
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
            Control::Subscribe { payload } => w.u8(1).u64(*payload),
            Control::Ready { payload, index, crc } => {
                w.u8(2).u64(*payload).u32(*index).opt(*crc, |w, c| {
                    w.u32(c);
                })
            }
            Control::Consumed { payload } => w.u8(3).u64(*payload),
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
            1 => Control::Subscribe { payload: r.u64()? },
            2 => Control::Ready {
                payload: r.u64()?,
                index: r.u32()?,
                crc: r.opt("crc", Reader::u32)?,
            },
            3 => Control::Consumed { payload: r.u64()? },
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
