//! `xfer --latency`: the time of one op at a time (not bandwidth), tensorwire against the raw
//! medium's round trip, samples interleaved in the same run. tcp: the raw-socket pair with the
//! same stream count and completion semantics (`raw_tcp`: a request, the bytes, a one-byte
//! answer). shm: a memcpy of the same bytes plus a wake-up round trip to another thread (what
//! one op needs at least: the copy, and telling the other side). mem: the memcpy alone. ucx: the
//! peer is a child process, as `ucx_perftest`'s two are; ucx_perftest gives no per-op samples to
//! interleave with, so each (size, op) runs its latency test at the median before tensorwire's
//! samples and at the 99th percentile after them (see `ucx_perftest::Perftest::latency`).

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use serde::Serialize;
use tensorwire_core::Error;

use crate::Result;
use crate::child_peer::ChildPair;
use crate::memcpy::Memcpy;
use crate::raw_tcp::RawTcp;
use crate::transfer::EnginePair;
use crate::ucx_perftest::Perftest;

/// One latency figure.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyLine {
    /// Tells the line apart.
    pub latency: bool,
    /// Backend.
    pub backend: String,
    /// "write" or "read".
    pub op: &'static str,
    /// Bytes per op.
    pub size: u64,
    /// Samples of each side.
    pub samples: usize,
    /// tensorwire's median, microseconds.
    pub p50_us: f64,
    /// tensorwire's 99th percentile, microseconds.
    pub p99_us: f64,
    /// The raw medium's median, microseconds.
    pub raw_p50_us: f64,
    /// The raw medium's 99th percentile, microseconds.
    pub raw_p99_us: f64,
    /// What the raw medium was.
    pub raw: &'static str,
}

/// The raw side of a latency measurement.
enum Raw {
    Tcp(RawTcp),
    CopyAndWake(Memcpy, Waker),
    Copy(Memcpy),
}

/// A thread that answers every wake-up: one round trip of two thread wake-ups.
struct Waker {
    to: SyncSender<()>,
    back: Receiver<()>,
}

impl Waker {
    fn new() -> Waker {
        let (to, rx) = sync_channel::<()>(0);
        let (tx, back) = sync_channel::<()>(0);
        std::thread::spawn(move || {
            while rx.recv().is_ok() {
                if tx.send(()).is_err() {
                    return;
                }
            }
        });
        Waker { to, back }
    }

    fn round_trip(&self) -> Result<()> {
        self.to.send(()).map_err(|_| Error::protocol("waker thread gone"))?;
        self.back.recv().map_err(|_| Error::protocol("waker thread gone"))?;
        Ok(())
    }
}

impl Raw {
    async fn op(&mut self, write: bool, size: u64) -> Result<()> {
        match self {
            Raw::Tcp(t) => t.op(write, size).await,
            Raw::CopyAndWake(m, w) => {
                m.copy(size);
                w.round_trip()
            }
            Raw::Copy(m) => {
                m.copy(size);
                Ok(())
            }
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((p * sorted.len() as f64) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(i).copied().unwrap_or(0.0)
}

/// (p50, p99) of `samples`, rounded to hundredths.
fn summary(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let r2 = |v: f64| (v * 100.0).round() / 100.0;
    (r2(percentile(&samples, 0.5)), r2(percentile(&samples, 0.99)))
}

/// Times `samples` calls of `op`, in microseconds.
async fn timed<F, Fut>(samples: usize, mut op: F) -> Result<Vec<f64>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        op().await?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

impl LatencyLine {
    fn new(
        backend: &str,
        (write, size, samples): (bool, u64, usize),
        ours: (f64, f64),
        raw: (f64, f64),
        what: &'static str,
    ) -> LatencyLine {
        LatencyLine {
            latency: true,
            backend: backend.to_string(),
            op: if write { "write" } else { "read" },
            size,
            samples,
            p50_us: ours.0,
            p99_us: ours.1,
            raw_p50_us: raw.0,
            raw_p99_us: raw.1,
            raw: what,
        }
    }
}

/// `samples` single ops of each size and direction on ucx, the peer in a child process, with
/// ucx_perftest's latency tests at the median before them and at the 99th percentile after.
async fn ucx(sizes: &[u64], ops: &[bool], samples: usize) -> Result<Vec<LatencyLine>> {
    let perf = Perftest::new()?;
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let pair = ChildPair::new("ucx", max, 1).await?;
    let mut out = Vec::new();
    for &size in sizes {
        for &write in ops {
            for _ in 0..10 {
                pair.op(write, size, "ucx").await?;
            }
            let n = samples as u64;
            let raw_p50 = perf.latency(write, size, n, 50.0).await?;
            let ours = summary(timed(samples, || pair.op(write, size, "ucx")).await?);
            let raw_p99 = perf.latency(write, size, n, 99.0).await?;
            let (what, at) = (Perftest::latency_name(write), (write, size, samples));
            out.push(LatencyLine::new("ucx", at, ours, (raw_p50, raw_p99), what));
        }
    }
    pair.a.shutdown().await;
    Ok(out)
}

/// `samples` single ops of each size and direction on `backend`, each followed by one raw op.
pub async fn run(
    backend: &str,
    streams: usize,
    sizes: &[u64],
    ops: &[bool],
    samples: usize,
) -> Result<Vec<LatencyLine>> {
    if backend == "ucx" {
        return ucx(sizes, ops, samples).await;
    }
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let pair = EnginePair::new(backend, streams, max).await?;
    let (mut raw, what) = match backend {
        "tcp" => (Raw::Tcp(RawTcp::new(streams, max).await?), "tokio socket round trip"),
        "shm" => (Raw::CopyAndWake(Memcpy::new(max), Waker::new()), "memcpy + wake round trip"),
        "mem" | "rdma" => (Raw::Copy(Memcpy::new(max)), "memcpy"),
        other => {
            return Err(Error::Unsupported {
                backend: "xfer",
                what: format!(
                    "--latency for {other} (tcp, shm, mem, rdma and ucx have a raw round trip)"
                ),
            }
            .into());
        }
    };
    let mut out = Vec::new();
    for &size in sizes {
        for &write in ops {
            // Warm up both sides.
            for _ in 0..10 {
                pair.op(write, size, backend).await?;
                raw.op(write, size).await?;
            }
            let (mut tw, mut rw) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
            for _ in 0..samples {
                let t = Instant::now();
                pair.op(write, size, backend).await?;
                tw.push(t.elapsed().as_secs_f64() * 1e6);
                let t = Instant::now();
                raw.op(write, size).await?;
                rw.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let at = (write, size, samples);
            out.push(LatencyLine::new(backend, at, summary(tw), summary(rw), what));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn measures_each_side_for_every_size_and_op() {
        let lines = run("mem", 1, &[4096, 1 << 16], &[true, false], 20).await.unwrap();
        assert_eq!(lines.len(), 4);
        for l in &lines {
            assert!(l.p50_us > 0.0 && l.p99_us >= l.p50_us, "{l:?}");
            assert!(l.raw_p50_us > 0.0 && l.raw_p99_us >= l.raw_p50_us, "{l:?}");
        }
        assert!(run("nope", 1, &[4096], &[true], 1).await.is_err());
    }
}
