//! `PayloadRef`: everything a consumer needs to fetch a payload, small enough to ride in a queue
//! message. Versioned codec; `decode` is total.

use std::net::SocketAddr;

use tensorwire_core::{Error, RemoteRegion, Result, TensorMeta};
use tensorwire_proto::wire::codec::{Reader, Writer};
use tensorwire_store::MAX_KEY;

use crate::payload::{Chunking, LeasePolicy, PayloadKind};

const VERSION: u8 = 2;

/// Where the bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// In the store under this key.
    Store {
        /// Store key.
        key: Vec<u8>,
    },
    /// In the producer's registered buffer.
    P2p {
        /// The producer engine's control endpoint.
        addr: SocketAddr,
        /// The producer connector's payload id.
        payload: u64,
        /// The region holding the buffer, as the consumer reaches it (engine, id, access key,
        /// backends' blobs): a consumer needs no descriptor refresh for a freshly registered buffer.
        region: RemoteRegion,
        /// Offset of the tensor's buffer in the region.
        offset: u64,
    },
}

/// A reference to a published payload.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadRef {
    /// Request.
    pub request: u64,
    /// Kind.
    pub kind: PayloadKind,
    /// Where it is.
    pub source: Source,
    /// The tensor.
    pub meta: TensorMeta,
    /// Chunked handoff, if any.
    pub chunking: Option<Chunking>,
    /// Lifetime.
    pub lease: LeasePolicy,
    /// crc32c of the payload's bytes (the chunk plan's extent), for store-relayed payloads
    /// published with checksums on (p2p chunks carry theirs in their announcements).
    pub checksum: Option<u32>,
}

impl PayloadRef {
    /// Encodes.
    pub fn encode(&self, w: &mut Writer) {
        w.u8(VERSION).u64(self.request);
        self.kind.encode(w);
        match &self.source {
            Source::Store { key } => {
                w.u8(0).bytes(key);
            }
            Source::P2p { addr, payload, region, offset } => {
                w.u8(1).str(&addr.to_string()).u64(*payload);
                region.encode(w);
                w.u64(*offset);
            }
        }
        self.meta.encode(w);
        w.opt(self.chunking, |w, c| {
            w.u32(c.dim).u32(c.count);
        });
        self.lease.encode(w);
        w.opt(self.checksum, |w, c| {
            w.u32(c);
        });
    }

    /// Decodes; never panics.
    pub fn decode(r: &mut Reader<'_>) -> Result<PayloadRef> {
        let v = r.u8()?;
        if v != VERSION {
            return Err(Error::protocol(format!(
                "payload ref version {v} (this build: {VERSION})"
            )));
        }
        let request = r.u64()?;
        let kind = PayloadKind::decode(r)?;
        let source = match r.u8()? {
            0 => Source::Store { key: r.bytes(MAX_KEY, "store key")?.to_vec() },
            1 => {
                let a = r.str(64, "address")?;
                let addr = a
                    .parse()
                    .map_err(|_| Error::protocol(format!("payload ref: bad address {a:?}")))?;
                let payload = r.u64()?;
                let region = RemoteRegion::decode(r)?;
                Source::P2p { addr, payload, region, offset: r.u64()? }
            }
            t => return Err(Error::protocol(format!("payload ref: unknown source {t}"))),
        };
        let meta = TensorMeta::decode(r)?;
        let chunking = r.opt("chunking", |r| Ok(Chunking { dim: r.u32()?, count: r.u32()? }))?;
        let lease = LeasePolicy::decode(r)?;
        let checksum = r.opt("checksum", Reader::u32)?;
        Ok(PayloadRef { request, kind, source, meta, chunking, lease, checksum })
    }

    /// Encoded as a standalone buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new();
        self.encode(&mut w);
        w.finish()
    }

    /// Decodes a standalone buffer (trailing bytes are an error).
    pub fn from_bytes(b: &[u8]) -> Result<PayloadRef> {
        let mut r = Reader::new(b, "payload ref");
        let p = PayloadRef::decode(&mut r)?;
        r.finish()?;
        Ok(p)
    }
}
