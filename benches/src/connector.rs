//! `xfer --connector`: publish + consume of one payload through the DiffusionConnector (p2p over
//! tcp) against a raw engine READ of the same bytes between the same engines, interleaved; and the
//! overlap figure: a chunked payload consumed while each landed chunk is "decoded" (a fixed sleep
//! per chunk), timed to the last decoded chunk, against max(transfer, decode) + one chunk's decode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tensorwire_core::{DType, Engine, Permissions, Region, Session, TensorMeta, TransferOp};
use tensorwire_diffusion::{
    Chunking, ConnectorConfig, DiffusionConnector, LeasePolicy, Mode, PayloadKind, StagePayload,
};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use crate::Result;

/// Two connectors (producer, consumer) over tcp engines, with buffers of one payload size.
#[derive(Debug)]
pub struct ConnectorBench {
    producer: DiffusionConnector,
    consumer: DiffusionConnector,
    src: Arc<Region>,
    dst: Arc<Region>,
    raw: Session,
    streams: usize,
}

async fn engine(streams: usize) -> Result<Engine> {
    let tcp = TcpBackend::new(TcpConfig { streams, ..TcpConfig::default() })?;
    Ok(Engine::builder().backend(tcp).start().await?)
}

/// A tensor of `size` bytes as [8, size/16] bf16 (so it can be chunked 8 ways along dim 0).
fn meta(size: u64) -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &[8, (size / 16).max(1)])
}

impl ConnectorBench {
    /// Builds both sides for payloads up to `max` bytes.
    pub async fn new(max: u64, streams: usize) -> Result<ConnectorBench> {
        let (a, b) = (engine(streams).await?, engine(streams).await?);
        let src = Arc::new(a.alloc(max, Permissions::READ).await?);
        let dst = Arc::new(b.alloc(max, Permissions::NONE).await?);
        src.write_bytes(0, &vec![3u8; max as usize])?;
        dst.write_bytes(0, &vec![4u8; max as usize])?;
        let raw = b.connect(a.local_addr()).await?;
        let cfg = || ConnectorConfig { mode: Mode::P2p, ..ConnectorConfig::default() };
        Ok(ConnectorBench {
            producer: DiffusionConnector::new(a, None, cfg()),
            consumer: DiffusionConnector::new(b, None, cfg()),
            src,
            dst,
            raw,
            streams,
        })
    }

    /// Streams per connection.
    pub fn streams(&self) -> usize {
        self.streams
    }

    fn payload(&self, size: u64, chunks: Option<u32>) -> StagePayload {
        StagePayload {
            request: 0,
            kind: PayloadKind::Latent,
            region: self.src.clone(),
            offset: 0,
            meta: meta(size),
            chunking: chunks.map(|count| Chunking { dim: 0, count }),
            lease: LeasePolicy::DeleteOnConsume { consumers: 1 },
        }
    }

    /// One publish + consume of `size` bytes.
    pub async fn handoff(&self, size: u64) -> Result<()> {
        let p = self.producer.publish(self.payload(size, None), None)?;
        self.consumer.consume(&p.reference, self.dst.clone(), 0, None)?.all().await?;
        Ok(())
    }

    /// One raw engine READ of the same bytes.
    pub async fn raw_read(&self, size: u64) -> Result<()> {
        let n = meta(size).nbytes()?;
        let op = TransferOp::read(&self.dst, 0, &self.src.remote(), 0, n);
        self.raw.transfer(op).await?;
        Ok(())
    }

    /// The overlap figure: the trial with the median ratio out of `trials`.
    pub async fn overlap(&self, size: u64, chunks: u32, trials: usize) -> Result<Overlap> {
        let mut all = Vec::new();
        for _ in 0..trials.max(1) {
            all.push(self.overlap_once(size, chunks).await?);
        }
        all.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
        let ratios: Vec<f64> = all.iter().map(|o| (o.ratio * 1000.0).round() / 1000.0).collect();
        let mut m = all.swap_remove(all.len() / 2);
        m.trial_ratios = ratios;
        Ok(m)
    }

    /// One overlap trial.
    async fn overlap_once(&self, size: u64, chunks: u32) -> Result<Overlap> {
        // The transfer alone (raw, median of 5).
        let mut t = Vec::new();
        for _ in 0..5 {
            let s = Instant::now();
            self.raw_read(size).await?;
            t.push(s.elapsed().as_secs_f64());
        }
        let transfer = crate::measure::median(&t);
        // Decode as slow as the transfer in total: the hardest case for overlap.
        let per_chunk = Duration::from_secs_f64(transfer / f64::from(chunks));
        let mut p = self.producer.publish(self.payload(size, Some(chunks)), None)?;
        p.mark_all_ready()?;
        let start = Instant::now();
        let mut c = self.consumer.consume(&p.reference, self.dst.clone(), 0, None)?;
        let (mut decode, mut longest) = (0.0f64, 0.0f64);
        while c.next().await?.is_some() {
            // "Decode" the chunk that landed: a sleep (a GPU kernel does not use the CPU that
            // moves the bytes). Timer granularity stretches sleeps, so the bound uses the time
            // the sleeps actually took.
            let s = Instant::now();
            tokio::time::sleep(per_chunk).await;
            let d = s.elapsed().as_secs_f64();
            decode += d;
            longest = longest.max(d);
        }
        let last = start.elapsed().as_secs_f64();
        let bound = transfer.max(decode) + longest;
        Ok(Overlap {
            overlap: true,
            size,
            chunks,
            transfer_ms: transfer * 1e3,
            decode_ms: decode * 1e3,
            chunk_decode_ms: longest * 1e3,
            last_decoded_ms: last * 1e3,
            ideal_ms: bound * 1e3,
            ratio: last / bound,
            serial_ms: (transfer + decode) * 1e3,
            trial_ratios: Vec::new(),
        })
    }
}

/// The overlap figure.
#[derive(Debug, Clone, Serialize)]
pub struct Overlap {
    /// Tells the line apart.
    pub overlap: bool,
    /// Payload bytes.
    pub size: u64,
    /// Chunks.
    pub chunks: u32,
    /// Raw transfer of the whole payload (median of 5), ms.
    pub transfer_ms: f64,
    /// Total simulated decode (measured sleeps), ms.
    pub decode_ms: f64,
    /// Longest decode of one chunk, ms.
    pub chunk_decode_ms: f64,
    /// Time from consume to the last decoded chunk, ms.
    pub last_decoded_ms: f64,
    /// max(transfer, decode) + one chunk's decode, ms.
    pub ideal_ms: f64,
    /// last_decoded / ideal (the target is <= 1.15).
    pub ratio: f64,
    /// transfer + decode without overlap, ms, for reference.
    pub serial_ms: f64,
    /// Every trial's ratio, sorted (this line is the median trial).
    pub trial_ratios: Vec<f64>,
}
