//! The store node's RPC, on the common framing ([`FRAMING`], magic "TR"): after the authenticated
//! handshake every frame's payload is a request id (u64) and a request or response body built
//! with the core codec, at most [`MAX_PAYLOAD`] bytes. Public for other clients of a node and for
//! the fuzz targets; [`crate::RemoteStore`] is the client to use. Bytes of objects never cross it: they move
//! by engine READ/WRITE straight between client regions and the node's pool. Every decoder is
//! total (proptest below, a cargo-fuzz target).

use std::net::SocketAddr;

use tensorwire_core::{AccessKey, Error, RegionId, Result, TensorMeta};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_proto::wire::frame::Framing;

use crate::api::{MAX_KEY, ObjectInfo, Retention, StoreStats};
use crate::error::{self, MAX_STORE_ERROR_BYTES, StoreError};

/// Largest payload.
pub const MAX_PAYLOAD: u32 = 64 << 10;
/// Most objects in one page of a listing (its answer stays under [`MAX_PAYLOAD`]: an entry is
/// at most a key of [`MAX_KEY`] bytes and 34 bytes more).
pub const MAX_LIST: usize = 200;
/// Longest socket address in text ("[ffff:...]:65535" is 47 bytes).
const MAX_ADDR: usize = 64;
/// The store RPC's framing.
pub const FRAMING: Framing =
    Framing { name: "store rpc", magic: *b"TR", version: 3, max_payload: MAX_PAYLOAD };

/// A request (field names say what the variant documentation describes).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Which region is the pool, and where is the node's engine?
    Hello,
    /// Proof of the pool's access key (learned through the engine handshake).
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
    /// A page of the objects: up to `limit` (at most [`MAX_LIST`]) with keys after `after`.
    List { after: Vec<u8>, limit: u32 },
}

/// A successful response (its shape follows the request; field names say what the variant
/// documentation describes).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Done.
    Done,
    /// The pool region and the control address of the node's engine (an unspecified IP means
    /// the address the client reached the RPC on).
    Pool { region: RegionId, engine: SocketAddr },
    /// A reservation.
    Reserved { ticket: u64, offset: u64 },
    /// An open read.
    Opened { ticket: u64, offset: u64, len: u64, meta: TensorMeta },
    /// A yes/no answer.
    Flag(bool),
    /// Counters.
    Stats(StoreStats),
    /// A page of the listing, in key order.
    Objects(Vec<ObjectInfo>),
}

/// Frame kind of a successful response.
pub const OK: u8 = 0x80;
/// Frame kind of a refusal (the body is an encoded [`StoreError`]).
pub const ERR: u8 = 0x81;

/// A whole frame: `kind`, request id `req`, body.
pub fn frame(kind: u8, req: u64, body: &[u8]) -> Result<Vec<u8>> {
    let mut w = Writer::new();
    w.u64(req).raw(body);
    FRAMING.encode(kind, &w.finish())
}

/// The whole frame answering request `req` with `r`.
pub fn reply(req: u64, r: &std::result::Result<Response, StoreError>) -> Result<Vec<u8>> {
    match r {
        Ok(resp) => frame(OK, req, &resp.encode()),
        Err(e) => frame(ERR, req, &error::encode(e)),
    }
}

/// Splits a frame's payload into its request id and body.
pub fn split(payload: &[u8]) -> Result<(u64, &[u8])> {
    let mut r = Reader::new(payload, "store rpc frame");
    Ok((r.u64()?, r.rest()))
}

impl Request {
    /// The frame kind and body.
    pub fn encode(&self) -> (u8, Vec<u8>) {
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
            Request::List { after, limit } => {
                w.bytes(after).u32(*limit);
                14
            }
        };
        (kind, w.finish())
    }

    /// Decodes a request; never panics.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<Request> {
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
            14 => Request::List { after: key(&mut r)?, limit: r.u32()? },
            k => return Err(Error::protocol(format!("store rpc: unknown request kind {k}"))),
        };
        r.finish()?;
        Ok(req)
    }
}

impl Response {
    /// The body of an [`OK`] frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Response::Done => {
                w.u8(0);
            }
            Response::Pool { region, engine } => {
                w.u8(1).u64(region.0).str(&engine.to_string());
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
            Response::Objects(list) => {
                w.u8(6).u32(list.len() as u32);
                for o in list {
                    let ttl = o.ttl_left.map_or(0, |t| {
                        u64::try_from(t.as_millis()).unwrap_or(u64::MAX - 1).saturating_add(1)
                    });
                    w.bytes(&o.key).u64(o.len).u8(o.retention.tag());
                    w.u32(o.pins).u32(o.consumers).u32(o.early).u64(ttl);
                }
            }
        }
        w.finish()
    }

    /// Decodes a response body of kind [`OK`] or [`ERR`]; never panics.
    pub fn decode(kind: u8, payload: &[u8]) -> Result<std::result::Result<Response, StoreError>> {
        if kind == ERR {
            if payload.len() > MAX_STORE_ERROR_BYTES {
                return Err(Error::protocol("store rpc: oversized error"));
            }
            return Ok(Err(error::decode(payload)?));
        }
        if kind != OK {
            return Err(Error::protocol(format!("store rpc: unknown response kind {kind}")));
        }
        let mut r = Reader::new(payload, "store response");
        let resp = match r.u8()? {
            0 => Response::Done,
            1 => {
                let region = RegionId(r.u64()?);
                let engine = r.str(MAX_ADDR, "engine address")?;
                let engine = engine.parse().map_err(|_| {
                    Error::protocol(format!("store rpc: bad engine address {engine:?}"))
                })?;
                Response::Pool { region, engine }
            }
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
            6 => {
                let n = r.u32()? as usize;
                if n > MAX_LIST {
                    return Err(Error::protocol(format!("store rpc: a page of {n} objects")));
                }
                let mut list = Vec::with_capacity(n);
                for _ in 0..n {
                    let key = r.bytes(MAX_KEY, "key")?.to_vec();
                    let (len, retention) = (r.u64()?, Retention::from_tag(r.u8()?)?);
                    let (pins, consumers, early) = (r.u32()?, r.u32()?, r.u32()?);
                    let ttl = r.u64()?;
                    let ttl_left = (ttl > 0).then(|| std::time::Duration::from_millis(ttl - 1));
                    list.push(ObjectInfo { key, len, retention, pins, consumers, early, ttl_left });
                }
                Response::Objects(list)
            }
            t => return Err(Error::protocol(format!("store rpc: unknown response tag {t}"))),
        };
        r.finish()?;
        Ok(Ok(resp))
    }
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
            Request::List { after: b"k".to_vec(), limit: 200 },
        ];
        for q in reqs {
            let (k, p) = q.encode();
            assert_eq!(Request::decode(k, &p).unwrap(), q);
        }
        let resps = [
            Response::Done,
            Response::Pool { region: RegionId(3), engine: "10.0.0.5:7000".parse().unwrap() },
            Response::Pool { region: RegionId(3), engine: "[::]:7000".parse().unwrap() },
            Response::Opened { ticket: 1, offset: 4096, len: 12, meta },
            Response::Stats(StoreStats { capacity: 1, used: 2, ..StoreStats::default() }),
            Response::Objects(vec![
                ObjectInfo {
                    key: vec![7; MAX_KEY],
                    len: 9,
                    retention: Retention::Pinned,
                    pins: 2,
                    consumers: 3,
                    early: 1,
                    ttl_left: Some(std::time::Duration::from_millis(1500)),
                },
                ObjectInfo {
                    key: b"k".to_vec(),
                    len: 0,
                    retention: Retention::Normal,
                    pins: 0,
                    consumers: 0,
                    early: 0,
                    ttl_left: None,
                },
            ]),
        ];
        for s in resps {
            assert_eq!(Response::decode(OK, &s.encode()).unwrap().unwrap(), s);
        }
        let f = frame(OK, 42, &Response::Done.encode()).unwrap();
        let (kind, payload) = FRAMING.decode(&f).unwrap();
        let (req, body) = split(payload).unwrap();
        assert_eq!((kind, req), (OK, 42));
        assert_eq!(Response::decode(kind, body).unwrap().unwrap(), Response::Done);
        let e = StoreError::not_found(b"k");
        let back = Response::decode(ERR, &error::encode(&e)).unwrap().unwrap_err();
        assert!(matches!(back, StoreError::NotFound { .. }));
        // A Pool answer whose address does not parse is refused, not guessed at.
        let mut w = Writer::new();
        w.u8(1).u64(3).str("not an address");
        assert!(Response::decode(OK, &w.finish()).is_err());
    }

    #[test]
    fn a_full_page_fits_a_frame() {
        let most = ObjectInfo {
            key: vec![0xff; MAX_KEY],
            len: u64::MAX,
            retention: Retention::Soft,
            pins: u32::MAX,
            consumers: u32::MAX,
            early: u32::MAX,
            ttl_left: Some(std::time::Duration::MAX),
        };
        let body = Response::Objects(vec![most; MAX_LIST]).encode();
        assert!(frame(OK, u64::MAX, &body).is_ok(), "{} bytes", body.len());
        let mut w = Writer::new();
        w.u8(6).u32(MAX_LIST as u32 + 1);
        assert!(Response::decode(OK, &w.finish()).is_err(), "an oversized page is refused");
    }

    proptest! {
        #[test]
        fn decoders_are_total(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Request::decode(kind, &bytes);
            let _ = Response::decode(kind, &bytes);
            let _ = split(&bytes);
        }
    }
}
