//! The measurements behind `xfer` and `tensorwire bench`, written once: each runs tensorwire and
//! the raw medium interleaved and returns one [`Line`] per (op, size), calling `on_line` as each
//! line is ready.

use crate::Result;
use std::future::Future;
use std::time::Duration;

use tensorwire_core::{Error, PreparedTransfer};

use crate::child_peer::ChildPair;
use crate::connector::{ConnectorBench, Overlap};
use crate::measure::{Budget, gbps, interleaved};
use crate::memcpy::SharedMemcpy;
use crate::raw_tcp::RawTcp;
use crate::report::Line;
use crate::store::{StoreBench, StoreMode};
use crate::transfer::{BACKENDS, EnginePair, post_checked};
use crate::ucx_perftest::Perftest;

/// How much to measure.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Interleaved runs per line.
    pub runs: usize,
    /// Time per sample.
    pub budget: Budget,
    /// Streams (tcp).
    pub streams: usize,
    /// Chunks for the overlap figure.
    pub chunks: u32,
    /// Where the initiator's side of every op starts in its page (one-process transfers; 0:
    /// page-aligned, as the remote side always is).
    pub page_offset: u64,
    /// Post transfer ops from a [`tensorwire_core::PreparedTransfer`] made once per line.
    pub prepared: bool,
}

impl Plan {
    /// A line's name: the backend's, with "-prepared" for prepared transfers.
    fn name(&self, backend: &str) -> String {
        if self.prepared { format!("{backend}-prepared") } else { backend.to_string() }
    }
}

/// Backend transfers against the raw medium.
pub async fn transfers(
    backend: &str,
    sizes: &[u64],
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    if !BACKENDS.contains(&backend) {
        return Err(Error::InvalidArgument(format!(
            "--backend {backend}: this harness knows {BACKENDS:?}"
        ))
        .into());
    }
    if backend == "ucx" {
        return ucx_transfers(sizes, ops, plan, on_line).await;
    }
    if backend == "cuda" {
        return cuda_transfers(sizes, ops, plan, on_line).await;
    }
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let streams = if backend == "tcp" { plan.streams.max(1) } else { 1 };
    let pair = EnginePair::at_page_offset(backend, streams, max, plan.page_offset).await?;
    let raw = if backend == "tcp" { Some(RawTcp::new(streams, max).await?) } else { None };
    let raw = tokio::sync::Mutex::new(raw);
    // The baseline of shm and mem, and the bound of every medium: tcp copies every byte twice
    // (into the socket, out of it), shm and mem once.
    let copy = SharedMemcpy::new(max);
    let copies = if backend == "tcp" { 2 } else { 1 };
    let baseline = if backend == "tcp" { socket_pair(false) } else { "memcpy" };
    let name = plan.name(backend);
    let against =
        Against { plan, backend, raw: &raw, copy: &copy, name: &name, streams, baseline, copies };
    let (pair_ref, against) = (&pair, &against);
    let lines =
        sweep(sizes, ops, on_line, move |size, write| against.line(pair_ref, size, write)).await?;
    pair.a.shutdown().await;
    pair.b.shutdown().await;
    if !["shm", "tcp"].contains(&backend) {
        return Ok(lines);
    }
    let two = two_process(backend, sizes, ops, plan, on_line, &copy).await?;
    Ok(lines.into_iter().chain(two).collect())
}

/// An initiator and its peer (in this process, or a child process): one op, or one prepared.
trait Pair {
    fn op(&self, write: bool, size: u64, backend: &str) -> impl Future<Output = Result<()>>;
    fn prepare(&self, write: bool, size: u64) -> impl Future<Output = Result<PreparedTransfer>>;
}

impl Pair for EnginePair {
    fn op(&self, write: bool, size: u64, backend: &str) -> impl Future<Output = Result<()>> {
        EnginePair::op(self, write, size, backend)
    }
    fn prepare(&self, write: bool, size: u64) -> impl Future<Output = Result<PreparedTransfer>> {
        EnginePair::prepare(self, write, size)
    }
}

impl Pair for ChildPair {
    fn op(&self, write: bool, size: u64, backend: &str) -> impl Future<Output = Result<()>> {
        ChildPair::op(self, write, size, backend)
    }
    fn prepare(&self, write: bool, size: u64) -> impl Future<Output = Result<PreparedTransfer>> {
        ChildPair::prepare(self, write, size)
    }
}

/// What a pair's ops are measured against, and how a line is named: the raw medium (the
/// socket pair, else a memcpy) and the bound of `copies` memcpys.
struct Against<'a> {
    plan: Plan,
    backend: &'a str,
    raw: &'a tokio::sync::Mutex<Option<RawTcp>>,
    copy: &'a SharedMemcpy,
    name: &'a str,
    streams: usize,
    baseline: &'a str,
    copies: u32,
}

impl Against<'_> {
    /// One line: `pair`'s op of `size` (prepared once, when the plan says so) against the raw
    /// medium's, interleaved.
    async fn line(&self, pair: &impl Pair, size: u64, write: bool) -> Result<Line> {
        let (plan, backend) = (self.plan, self.backend);
        let prep = match plan.prepared {
            true => Some(pair.prepare(write, size).await?),
            false => None,
        };
        let prep = &prep;
        let (tw, base) = interleaved(
            plan.runs,
            plan.budget,
            size,
            || async move {
                match prep {
                    Some(p) => post_checked(p, backend).await,
                    None => pair.op(write, size, backend).await,
                }
            },
            || raw_op(self.raw, self.copy, write, size),
        )
        .await?;
        let op = if write { "write" } else { "read" };
        let line = Line::from_samples(self.name, op, size, self.streams, self.baseline, tw, base);
        Ok(line.bounded(self.copies, self.copy.gbps(size, plan.budget)))
    }
}

/// One op of the raw medium: the socket pair's when there is one (tcp), else a memcpy.
async fn raw_op(
    raw: &tokio::sync::Mutex<Option<RawTcp>>,
    copy: &SharedMemcpy,
    write: bool,
    size: u64,
) -> Result<()> {
    match raw.lock().await.as_mut() {
        Some(r) => r.op(write, size).await,
        None => {
            copy.copy(size);
            Ok(())
        }
    }
}

/// The socket pair's name in a line: its server in a child process or not, lingering or not.
fn socket_pair(two_process: bool) -> &'static str {
    match (two_process, crate::raw_tcp::lingers()) {
        (false, false) => "tokio-socket",
        (false, true) => "tokio-socket-lingering",
        (true, false) => "tokio-socket-2p",
        (true, true) => "tokio-socket-2p-lingering",
    }
}

/// shm and tcp between two processes, as every deployment runs them: the same sizes, the peer
/// this binary re-run as a child (lines named "shm-2p", "tcp-2p"); shm against the same memcpy,
/// tcp against the socket pair with its server in the child too.
async fn two_process(
    backend: &str,
    sizes: &[u64],
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
    copy: &SharedMemcpy,
) -> Result<Vec<Line>> {
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let name = plan.name(&format!("{backend}-2p"));
    eprintln!("  {backend} between two processes (the peer a child process), lines {name:?}:");
    let streams = if backend == "tcp" { plan.streams.max(1) } else { 1 };
    let child = ChildPair::new(backend, max, streams).await?;
    let raw = match child.raw {
        Some(at) => Some(RawTcp::connect(at, streams, max).await?),
        None => None,
    };
    let (copies, baseline) = if raw.is_some() { (2, socket_pair(true)) } else { (1, "memcpy") };
    let raw = tokio::sync::Mutex::new(raw);
    let against =
        Against { plan, backend, raw: &raw, copy, name: &name, streams, baseline, copies };
    let (child_ref, against) = (&child, &against);
    let lines =
        sweep(sizes, ops, on_line, move |size, write| against.line(child_ref, size, write)).await?;
    child.a.shutdown().await;
    Ok(lines)
}

/// Batches of `n` ops of each size per submit (consecutive offsets of one region pair) against
/// the raw medium doing the same ops: for tcp the socket pair pipelining `n` requests and their
/// answers over the same streams, for shm and mem `n` memcpys.
pub async fn batches(
    backend: &str,
    sizes: &[u64],
    n: usize,
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    if !["tcp", "shm", "mem"].contains(&backend) {
        return Err(Error::InvalidArgument(format!(
            "--batch measures tcp, shm and mem, not {backend:?}"
        ))
        .into());
    }
    let n = n.max(1);
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let tcp = backend == "tcp";
    let streams = if tcp { plan.streams.max(1) } else { 1 };
    let pair = EnginePair::new(backend, streams, max * n as u64).await?;
    // Each raw stream needs room for one op's source and destination.
    let raw = if tcp { Some(RawTcp::new(streams, 2 * max * streams as u64).await?) } else { None };
    let raw = tokio::sync::Mutex::new(raw);
    let copy = SharedMemcpy::new(max);
    let baseline = if tcp { socket_pair(false) } else { "memcpy" };
    let (pair_ref, raw, copy) = (&pair, &raw, &copy);
    let lines = sweep(sizes, ops, on_line, move |size, write| async move {
        let (tw, base) = interleaved(
            plan.runs,
            plan.budget,
            size * n as u64,
            || pair_ref.batch(write, size, n, backend),
            || async {
                match raw.lock().await.as_mut() {
                    Some(r) => r.batch(write, size, n).await,
                    None => {
                        (0..n).for_each(|_| copy.copy(size));
                        Ok(())
                    }
                }
            },
        )
        .await?;
        let op = if write { "write" } else { "read" };
        Ok(Line::from_samples(backend, op, size, streams, baseline, tw, base).batched(n))
    })
    .await?;
    pair.a.shutdown().await;
    pair.b.shutdown().await;
    Ok(lines)
}

/// The backend moving GPU memory on both sides (staged through pinned bounces where it moves
/// host memory) against the same backend moving host memory, interleaved in one run.
pub async fn device_vs_host(
    backend: &str,
    sizes: &[u64],
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let streams = plan.streams.max(1);
    let dev = EnginePair::on_gpu(backend, streams, max, true).await?;
    let host = EnginePair::on_gpu(backend, streams, max, false).await?;
    let (dev_ref, host_ref) = (&dev, &host);
    let name = format!("{backend}-device");
    let baseline = format!("{backend}-host");
    let (name, baseline) = (&name, &baseline);
    let lines = sweep(sizes, ops, on_line, move |size, write| async move {
        let (tw, base) = interleaved(
            plan.runs,
            plan.budget,
            size,
            || dev_ref.op(write, size, backend),
            || host_ref.op(write, size, backend),
        )
        .await?;
        let op = if write { "write" } else { "read" };
        Ok(Line::from_samples(name, op, size, streams, baseline, tw, base))
    })
    .await?;
    for p in [dev, host] {
        p.a.shutdown().await;
        p.b.shutdown().await;
    }
    Ok(lines)
}

/// Ops per submit in the batched UCX measurement.
const UCX_BATCH: usize = 16;

/// UCX transfers against `ucx_perftest` (one process pair per sample, same size and UCX
/// environment), runs alternating which side goes first. Like ucx_perftest, the two engines are
/// two processes: the peer is this binary re-run as a child (see `child_peer`).
async fn ucx_transfers(
    sizes: &[u64],
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    let perf = Perftest::new()?;
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let pair = ChildPair::new("ucx", max, 1).await?;
    // The bound: UCX's shared memory moves each byte with one copy.
    let copy = SharedMemcpy::new(max);
    let (pair_ref, perf, copy) = (&pair, &perf, &copy);
    // Each size and direction twice: one op at a time (each waits for the one before), and
    // UCX_BATCH ops per submit, each completing on its own (ucx_perftest streams its puts).
    let mut lines = Vec::new();
    for batch in [1, UCX_BATCH] {
        lines.extend(
            sweep(sizes, ops, on_line, move |size, write| async move {
                let (mut tw, mut base) = (Vec::new(), Vec::new());
                let bytes = size * batch as u64;
                for run in 0..plan.runs.max(1) {
                    let ours =
                        || gbps(plan.budget, bytes, || pair_ref.ops(write, size, batch, "ucx"));
                    if run % 2 == 0 {
                        base.push(perf.sample(write, size, plan.budget).await?);
                        tw.push(ours().await?);
                    } else {
                        tw.push(ours().await?);
                        base.push(perf.sample(write, size, plan.budget).await?);
                    }
                }
                let op = match (write, batch) {
                    (true, 1) => "write".to_string(),
                    (false, 1) => "read".to_string(),
                    (true, n) => format!("write x{n}"),
                    (false, n) => format!("read x{n}"),
                };
                let line = Line::from_samples("ucx", &op, size, 1, &perf.name(), tw, base);
                let memcpy = copy.gbps(size, plan.budget);
                Ok(line.bounded(1, memcpy))
            })
            .await?,
        );
    }
    // Idle: connected, nothing moving. The progress thread should sleep in poll(2).
    let idle = Duration::from_secs(1);
    let before = crate::thread_cpu::used("tensorwire-ucx");
    tokio::time::sleep(idle).await;
    let spent = crate::thread_cpu::used("tensorwire-ucx").saturating_sub(before);
    eprintln!(
        "    idle     ucx: progress thread used {} ms of CPU in {} ms with nothing to move",
        spent.as_millis(),
        idle.as_millis()
    );
    pair.a.shutdown().await;
    Ok(lines)
}

/// The cuda backend between two processes (the peer is this binary re-run as a child, see
/// `child_peer`), device memory of GPU 0 on both sides, against `cuMemcpyDtoD` between two
/// device buffers of this process, interleaved. The bytes of one round trip at the largest size
/// are checked first.
async fn cuda_transfers(
    sizes: &[u64],
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    let gpu = tensorwire_cuda::CudaGpu::new()?; // before the child: say once why there is none
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let pair = ChildPair::new("cuda", max, 1).await?;
    pair.verify(max, "cuda").await?;
    eprintln!("    verified cuda: a {max}-byte round trip between two processes is exact");
    let (src, dst) = (
        pair.a.alloc_device(0, max, tensorwire_core::Permissions::NONE).await?,
        pair.a.alloc_device(0, max, tensorwire_core::Permissions::NONE).await?,
    );
    let (s, d) = (src.slice(0, max)?.ptr() as u64, dst.slice(0, max)?.ptr() as u64);
    let (pair_ref, gpu) = (&pair, &gpu);
    let lines = sweep(sizes, ops, on_line, move |size, write| async move {
        let (tw, base) = interleaved(
            plan.runs,
            plan.budget,
            size,
            || pair_ref.op(write, size, "cuda"),
            || async move {
                let n = usize::try_from(size).map_err(|_| Error::protocol("size"))?;
                // SAFETY: `src` and `dst` are live device regions of `max >= size` bytes held
                // until the sweep is over.
                unsafe { gpu.memcpy_dtod(0, d, s, n) }?;
                Ok(())
            },
        )
        .await?;
        let op = if write { "write" } else { "read" };
        Ok(Line::from_samples("cuda", op, size, 1, "cuMemcpyDtoD", tw, base))
    })
    .await?;
    drop((src, dst));
    pair.a.shutdown().await;
    Ok(lines)
}

/// Store put_from / get_into against memcpy (embedded) or a raw engine transfer (remote).
pub async fn store(
    mode: StoreMode,
    sizes: &[u64],
    ops: &[bool],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let bench = StoreBench::new(mode, max, plan.streams.max(1)).await?;
    let bench = &bench;
    sweep(sizes, ops, on_line, move |size, write| async move {
        let (tw, base) = interleaved(
            plan.runs,
            plan.budget,
            size,
            || bench.store_op(write, size),
            || bench.baseline_op(write, size),
        )
        .await?;
        let op = if write { "put_from" } else { "get_into" };
        let (name, streams, baseline) = (bench.name(), bench.streams(), bench.baseline());
        Ok(Line::from_samples(name, op, size, streams, baseline, tw, base))
    })
    .await
}

/// Connector publish + consume against a raw engine READ, then the overlap figure per size.
pub async fn connector(
    sizes: &[u64],
    plan: Plan,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<(Vec<Line>, Vec<Overlap>)> {
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let bench = ConnectorBench::new(max, plan.streams.max(1)).await?;
    let bench_ref = &bench;
    let lines = sweep(sizes, &[false], on_line, move |size, _| async move {
        let (tw, base) = interleaved(
            plan.runs,
            plan.budget,
            size,
            || bench_ref.handoff(size),
            || bench_ref.raw_read(size),
        )
        .await?;
        let (op, streams) = ("publish+consume", bench_ref.streams());
        Ok(Line::from_samples("connector-p2p", op, size, streams, "engine-tcp", tw, base))
    })
    .await?;
    let mut overlaps = Vec::new();
    for &size in sizes {
        overlaps.push(bench.overlap(size, plan.chunks, plan.runs).await?);
    }
    Ok((lines, overlaps))
}

/// One line per (size, op), in that order, each passed to `on_line` as soon as it is measured.
async fn sweep<F>(
    sizes: &[u64],
    ops: &[bool],
    on_line: &(dyn Fn(&Line) + Sync),
    measure: impl Fn(u64, bool) -> F,
) -> Result<Vec<Line>>
where
    F: Future<Output = Result<Line>>,
{
    let mut lines = Vec::new();
    for &size in sizes {
        for &write in ops {
            let line = measure(size, write).await?;
            on_line(&line);
            lines.push(line);
        }
    }
    Ok(lines)
}
