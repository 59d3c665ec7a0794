//! Connector control messages, carried in engine notifications (ordered after the data they
//! follow): a consumer subscribes to a p2p payload, the producer announces each chunk as it becomes
//! ready (with its crc32c when checksums are on), the consumer reports when it is done, and a
//! producer that cannot serve says why. Versioned and total.

use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::wire::error::{MAX_ERROR_BYTES, decode_error, encode_error};
use tensorwire_core::{Error, Result};

const MAGIC: [u8; 4] = *b"TWDC";
const VERSION: u8 = 1;

/// A control message about one payload of the producer.
#[derive(Debug, Clone)]
pub(crate) enum Control {
    /// Consumer -> producer: send me chunk announcements for `payload`.
    Subscribe { payload: u64 },
    /// Producer -> consumer: chunk `index` of `payload` is ready.
    Ready { payload: u64, index: u32, crc: Option<u32> },
    /// Consumer -> producer: done with `payload`.
    Consumed { payload: u64 },
    /// Producer -> consumer: `payload` cannot be served.
    Gone { payload: u64, error: Error },
}

impl Control {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(&MAGIC).u8(VERSION);
        match self {
            Control::Subscribe { payload } => {
                w.u8(1).u64(*payload);
            }
            Control::Ready { payload, index, crc } => {
                w.u8(2).u64(*payload).u32(*index);
                match crc {
                    Some(c) => w.u8(1).u32(*c),
                    None => w.u8(0),
                };
            }
            Control::Consumed { payload } => {
                w.u8(3).u64(*payload);
            }
            Control::Gone { payload, error } => {
                w.u8(4).u64(*payload).bytes(&encode_error(error));
            }
        }
        w.finish()
    }

    /// Decodes; `Ok(None)` for a notification that is not a connector message.
    pub(crate) fn decode(b: &[u8]) -> Result<Option<Control>> {
        if b.len() < 5 || b[..4] != MAGIC {
            return Ok(None);
        }
        let mut r = Reader::new(&b[4..], "connector control");
        let v = r.u8()?;
        if v != VERSION {
            return Err(Error::protocol(format!("connector control version {v}")));
        }
        let c = match r.u8()? {
            1 => Control::Subscribe { payload: r.u64()? },
            2 => {
                let (payload, index) = (r.u64()?, r.u32()?);
                let crc = match r.u8()? {
                    0 => None,
                    1 => Some(r.u32()?),
                    t => return Err(Error::protocol(format!("connector control: crc tag {t}"))),
                };
                Control::Ready { payload, index, crc }
            }
            3 => Control::Consumed { payload: r.u64()? },
            4 => {
                let payload = r.u64()?;
                let error = decode_error(r.bytes(MAX_ERROR_BYTES, "error")?)?;
                Control::Gone { payload, error }
            }
            t => return Err(Error::protocol(format!("connector control: unknown kind {t}"))),
        };
        r.finish()?;
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let m = Control::Ready { payload: 3, index: 6, crc: Some(9) };
        assert!(matches!(
            Control::decode(&m.encode()).unwrap(),
            Some(Control::Ready { payload: 3, index: 6, crc: Some(9) })
        ));
        let g = Control::Gone { payload: 1, error: Error::AccessDenied("x".into()) };
        assert!(matches!(
            Control::decode(&g.encode()).unwrap(),
            Some(Control::Gone { error: Error::AccessDenied(_), .. })
        ));
        assert!(Control::decode(b"user payload").unwrap().is_none());
    }

    proptest! {
        #[test]
        fn decode_is_total(mut bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Control::decode(&bytes);
            if bytes.len() >= 5 { bytes[..4].copy_from_slice(&MAGIC); bytes[4] = VERSION; }
            let _ = Control::decode(&bytes);
        }
    }
}
