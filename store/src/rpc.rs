//! The store node's RPC: 16-byte headers (magic "TR", version, kind, payload length, request id)
//! and payloads of at most [`MAX_PAYLOAD`] bytes built with the core codec. Bytes of objects never
//! cross it: they move by engine READ/WRITE straight between client regions and the node's pool.
//! Every decoder is total (proptest below).

use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::wire::error::{decode_error, encode_error};
use tensorwire_core::{AccessKey, Error, RegionId, Result, TensorMeta};

use crate::api::{MAX_KEY, Retention, StoreStats};

/// Header length.
pub(crate) const HEADER_LEN: usize = 16;
const MAGIC: [u8; 2] = *b"TR";
const VERSION: u8 = 1;
/// Largest payload.
pub(crate) const MAX_PAYLOAD: u32 = 64 << 10;

/// A request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Request {
    /// Which region is the pool?
    Hello,
    /// Proof of the pool's access key (learned through an authenticated engine handshake).
    Auth { region: RegionId, key: AccessKey },
    /// Reserve pool space for a put.
    Reserve { key: Vec<u8>, meta: TensorMeta, len: u64, retention: Retention },
    /// Publish a reserved put.
    Commit { ticket: u64 },
    /// Drop a reserved put.
    Abort { ticket: u64 },
    /// Open a read (a spilled object is loaded into the pool first).
    Open { key: Vec<u8> },
    /// Close a read.
    Close { ticket: u64 },
    /// Does `key` exist?
    Exists { key: Vec<u8> },
    /// Remove `key`.
    Remove { key: Vec<u8> },
    /// Pin (`up`) or unpin `key`.
    Pin { key: Vec<u8>, up: bool },
    /// Counters.
    Stats,
    /// Set a lease (ttl in milliseconds, 0 for none).
    Lease { key: Vec<u8>, consumers: u32, ttl_ms: u64 },
    /// One consumer is done.
    Consumed { key: Vec<u8> },
}

/// A successful response (its shape follows the request).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Response {
    /// Done.
    Done,
    /// The pool region.
    Pool(RegionId),
    /// A reservation.
    Reserved { ticket: u64, offset: u64 },
    /// An open read.
    Opened { ticket: u64, offset: u64, len: u64, meta: TensorMeta },
    /// A yes/no answer.
    Flag(bool),
    /// Counters.
    Stats(StoreStats),
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: u8,
    pub(crate) len: u32,
    pub(crate) req: u64,
}

/// Response kinds.
pub(crate) const OK: u8 = 0x80;
pub(crate) const ERR: u8 = 0x81;

pub(crate) fn encode_header(h: Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[..2].copy_from_slice(&MAGIC);
    b[2] = VERSION;
    b[3] = h.kind;
    b[4..8].copy_from_slice(&h.len.to_le_bytes());
    b[8..16].copy_from_slice(&h.req.to_le_bytes());
    b
}

pub(crate) fn decode_header(b: &[u8]) -> Result<Header> {
    let b: &[u8; HEADER_LEN] = b
        .try_into()
        .map_err(|_| Error::protocol(format!("store rpc header is {} bytes", b.len())))?;
    if b[..2] != MAGIC {
        return Err(Error::protocol("store rpc: bad magic"));
    }
    if b[2] != VERSION {
        return Err(Error::protocol(format!(
            "store rpc version {} not supported (this build speaks {VERSION})",
            b[2]
        )));
    }
    let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    if len > MAX_PAYLOAD {
        return Err(Error::Capacity {
            what: "store rpc payload".into(),
            requested: len.into(),
            limit: MAX_PAYLOAD.into(),
        });
    }
    let mut r = [0u8; 8];
    r.copy_from_slice(&b[8..16]);
    Ok(Header { kind: b[3], len, req: u64::from_le_bytes(r) })
}

/// A whole frame.
pub(crate) fn frame(kind: u8, req: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&encode_header(Header { kind, len: payload.len() as u32, req }));
    out.extend_from_slice(payload);
    out
}

impl Request {
    /// (kind, payload)
    pub(crate) fn encode(&self) -> (u8, Vec<u8>) {
        let mut w = Writer::new();
        let kind = match self {
            Request::Hello => 1,
            Request::Auth { region, key } => {
                w.u64(region.0).u128(key.to_bits());
                2
            }
            Request::Reserve { key, meta, len, retention } => {
                w.bytes(key);
                meta.encode(&mut w);
                w.u64(*len).u8(retention.tag());
                3
            }
            Request::Commit { ticket } => {
                w.u64(*ticket);
                4
            }
            Request::Abort { ticket } => {
                w.u64(*ticket);
                5
            }
            Request::Open { key } => {
                w.bytes(key);
                6
            }
            Request::Close { ticket } => {
                w.u64(*ticket);
                7
            }
            Request::Exists { key } => {
                w.bytes(key);
                8
            }
            Request::Remove { key } => {
                w.bytes(key);
                9
            }
            Request::Pin { key, up } => {
                w.bytes(key).u8(u8::from(*up));
                10
            }
            Request::Stats => 11,
            Request::Lease { key, consumers, ttl_ms } => {
                w.bytes(key).u32(*consumers).u64(*ttl_ms);
                12
            }
            Request::Consumed { key } => {
                w.bytes(key);
                13
            }
        };
        (kind, w.finish())
    }

    /// Decodes a request; never panics.
    pub(crate) fn decode(kind: u8, payload: &[u8]) -> Result<Request> {
        let mut r = Reader::new(payload, "store request");
        let key = |r: &mut Reader<'_>| r.bytes(MAX_KEY, "key").map(<[u8]>::to_vec);
        let req = match kind {
            1 => Request::Hello,
            2 => Request::Auth { region: RegionId(r.u64()?), key: AccessKey::from_bits(r.u128()?) },
            3 => Request::Reserve {
                key: key(&mut r)?,
                meta: TensorMeta::decode(&mut r)?,
                len: r.u64()?,
                retention: Retention::from_tag(r.u8()?)?,
            },
            4 => Request::Commit { ticket: r.u64()? },
            5 => Request::Abort { ticket: r.u64()? },
            6 => Request::Open { key: key(&mut r)? },
            7 => Request::Close { ticket: r.u64()? },
            8 => Request::Exists { key: key(&mut r)? },
            9 => Request::Remove { key: key(&mut r)? },
            10 => Request::Pin { key: key(&mut r)?, up: r.u8()? != 0 },
            11 => Request::Stats,
            12 => Request::Lease { key: key(&mut r)?, consumers: r.u32()?, ttl_ms: r.u64()? },
            13 => Request::Consumed { key: key(&mut r)? },
            k => return Err(Error::protocol(format!("store rpc: unknown request kind {k}"))),
        };
        r.finish()?;
        Ok(req)
    }
}

impl Response {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Response::Done => {
                w.u8(0);
            }
            Response::Pool(id) => {
                w.u8(1).u64(id.0);
            }
            Response::Reserved { ticket, offset } => {
                w.u8(2).u64(*ticket).u64(*offset);
            }
            Response::Opened { ticket, offset, len, meta } => {
                w.u8(3).u64(*ticket).u64(*offset).u64(*len);
                meta.encode(&mut w);
            }
            Response::Flag(b) => {
                w.u8(4).u8(u8::from(*b));
            }
            Response::Stats(s) => {
                w.u8(5)
                    .u64(s.capacity)
                    .u64(s.used)
                    .u64(s.objects)
                    .u64(s.spilled_objects)
                    .u64(s.evictions)
                    .u64(s.largest_free);
            }
        }
        w.finish()
    }

    /// Decodes a response payload of kind [`OK`] or [`ERR`]; never panics.
    pub(crate) fn decode(kind: u8, payload: &[u8]) -> Result<Result<Response>> {
        if kind == ERR {
            return Ok(Err(decode_error(payload)?));
        }
        if kind != OK {
            return Err(Error::protocol(format!("store rpc: unknown response kind {kind}")));
        }
        let mut r = Reader::new(payload, "store response");
        let resp = match r.u8()? {
            0 => Response::Done,
            1 => Response::Pool(RegionId(r.u64()?)),
            2 => Response::Reserved { ticket: r.u64()?, offset: r.u64()? },
            3 => Response::Opened {
                ticket: r.u64()?,
                offset: r.u64()?,
                len: r.u64()?,
                meta: TensorMeta::decode(&mut r)?,
            },
            4 => Response::Flag(r.u8()? != 0),
            5 => Response::Stats(StoreStats {
                capacity: r.u64()?,
                used: r.u64()?,
                objects: r.u64()?,
                spilled_objects: r.u64()?,
                evictions: r.u64()?,
                largest_free: r.u64()?,
            }),
            t => return Err(Error::protocol(format!("store rpc: unknown response tag {t}"))),
        };
        r.finish()?;
        Ok(Ok(resp))
    }
}

/// An error response payload.
pub(crate) fn error_payload(e: &Error) -> Vec<u8> {
    encode_error(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tensorwire_core::DType;

    #[test]
    fn round_trips() {
        let meta = TensorMeta::contiguous(DType::BF16, &[2, 3]);
        let reqs = [
            Request::Hello,
            Request::Auth { region: RegionId(4), key: AccessKey::from_bits(99) },
            Request::Reserve {
                key: b"k".to_vec(),
                meta: meta.clone(),
                len: 12,
                retention: Retention::Soft,
            },
            Request::Open { key: b"k".to_vec() },
            Request::Pin { key: b"k".to_vec(), up: true },
            Request::Stats,
        ];
        for q in reqs {
            let (k, p) = q.encode();
            assert_eq!(Request::decode(k, &p).unwrap(), q);
        }
        let resps = [
            Response::Done,
            Response::Opened { ticket: 1, offset: 4096, len: 12, meta },
            Response::Stats(StoreStats { capacity: 1, used: 2, ..StoreStats::default() }),
        ];
        for s in resps {
            assert_eq!(Response::decode(OK, &s.encode()).unwrap().unwrap(), s);
        }
        let h = Header { kind: OK, len: 7, req: 42 };
        assert_eq!(decode_header(&encode_header(h)).unwrap(), h);
        let mut big = encode_header(h);
        big[4..8].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(matches!(decode_header(&big), Err(Error::Capacity { .. })));
    }

    proptest! {
        #[test]
        fn decoders_are_total(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Request::decode(kind, &bytes);
            let _ = Response::decode(kind, &bytes);
            let _ = decode_header(&bytes);
        }
    }
}
