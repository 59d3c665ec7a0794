//! `xfer`: tensorwire against the raw medium, interleaved in one run.
//!
//! ```text
//! cargo run --release -p tensorwire-benches --bin xfer -- --backend tcp --sizes 64M,256M --runs 5
//! cargo run --release -p tensorwire-benches --bin xfer -- --store remote --sizes 64M
//! cargo run --release -p tensorwire-benches --bin xfer -- --backend shm --latency
//! cargo run --release -p tensorwire-benches --bin xfer -- --cluster-store --sizes 1M
//! cargo run --release -p tensorwire-benches --bin xfer -- --backend tcp --batch 1024 --sizes 4K
//! cargo run --release -p tensorwire-benches --bin xfer -- --scale
//! cargo run --release -p tensorwire-benches --bin xfer -- --copy --sizes 4K,64K,1M
//! ```
//! Prints one JSON line per (op, size) with the medians of `--runs` interleaved runs and the
//! median of the runs' ratios (`measure::interleaved` says how a run interleaves), then a summary
//! line. Progress goes to stderr.

use std::process::ExitCode;
use std::time::{Duration, Instant};
use tensorwire_benches::Result;

use clap::{Parser, ValueEnum};
use tensorwire_benches::measure::{Budget, fmt_size, median, parse_size};
use tensorwire_benches::report::{Line, Summary};
use tensorwire_benches::store::StoreMode;
use tensorwire_benches::suite::{self, Plan};
use tensorwire_core::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpArg {
    Read,
    Write,
    Both,
}

/// Which thread runs the measurement (both sides of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Caller {
    /// A task on a runtime worker, as in a server: completions wake a worker that may be
    /// running already.
    Task,
    /// The process's main thread, outside the runtime's workers, as a synchronous caller (the
    /// Python binding, a blocking Rust program) runs: every wait parks that thread and a
    /// worker wakes it.
    Blocking,
}

/// Measure tensorwire against the raw medium, interleaved, one JSON line per measurement.
/// Transfers: tcp against a plain tokio socket pair with the same stream count; shm and mem
/// against memcpy in one process. `--store`: put_from / get_into against memcpy (embedded) or a
/// raw tcp engine transfer of the same bytes (remote).
#[derive(Debug, Parser)]
#[command(name = "xfer")]
struct Args {
    /// Backend to measure.
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Record metrics as a process with `--metrics-listen` does (the Prometheus recorder
    /// installed; nothing scrapes it), to measure what recording costs.
    #[arg(long)]
    metrics: bool,
    /// Measure the store instead of raw transfers.
    #[arg(long, value_enum)]
    store: Option<StoreMode>,
    /// Measure the cluster store: aggregate put/get of --clients clients (--objects each) on 1
    /// node, 3 nodes and 3 nodes with 2 replicas, then the repair after a node loss.
    #[arg(long)]
    cluster_store: bool,
    /// Clients for --cluster-store.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Objects per client for --cluster-store (and, times 8, stored for the repair figure).
    #[arg(long, default_value_t = 32)]
    objects: usize,
    /// Measure the DiffusionConnector (p2p over tcp): publish + consume against a raw engine
    /// READ, then the chunked overlap figure.
    #[arg(long)]
    connector: bool,
    /// Measure the backend moving GPU memory (device regions on both engines, through the CUDA
    /// driver) against the same backend moving host memory, interleaved; needs a GPU.
    #[arg(long)]
    device: bool,
    /// Measure the orchestrator's scheduler: decisions per second and dispatch latency with
    /// --workers workers and --requests requests (one core, no I/O).
    #[arg(long)]
    orchestrator: bool,
    /// Measure the CPU copy of the memory backends (`copy_bytes`) against memcpy at each of
    /// --distances (bytes between the destination's and the source's page offsets), with
    /// memcpy between page-aligned buffers as the bound.
    #[arg(long)]
    copy: bool,
    /// Where the initiator's side of every op starts in its page, in bytes (transfers in one
    /// process; the peer's side is page-aligned, the baseline memcpy's both sides): 16 is a
    /// buffer from `malloc`.
    #[arg(long, default_value_t = 0)]
    page_offset: u64,
    /// Post each transfer op from a `PreparedTransfer` (checked and routed once) instead of
    /// submitting it: lines "shm-prepared", "shm-2p-prepared" and so on.
    #[arg(long)]
    prepared: bool,
    /// Distances for --copy.
    #[arg(long, default_value = "0,16", value_delimiter = ',')]
    distances: Vec<usize>,
    /// Measure the latency of one op at a time (p50 and p99 of --samples ops of each of
    /// --latency-sizes, both directions) next to the raw medium's round trip.
    #[arg(long)]
    latency: bool,
    /// Sizes for --latency.
    #[arg(long, default_value = "4K,1M", value_delimiter = ',')]
    latency_sizes: Vec<String>,
    /// Ops of each side per (size, direction) for --latency.
    #[arg(long, default_value_t = 1000)]
    samples: usize,
    /// Measure how the per-op cost grows with regions, peers, ops per batch, store objects,
    /// scheduler workers and requests in flight (`tensorwire_benches::scale`); one JSON line
    /// per point, then one per curve.
    #[arg(long)]
    scale: bool,
    /// With --scale: the issue's counts (`full`) or small ones (`smoke`).
    #[arg(long, default_value = "full", value_parser = ["full", "smoke"])]
    scale_limits: String,
    /// Measure batches of this many ops of each --sizes per submit (tcp, shm, mem) against the
    /// raw medium doing the same ops; lines add ops per second.
    #[arg(long, default_value_t = 0)]
    batch: usize,
    /// Workers for --orchestrator.
    #[arg(long, default_value_t = 1000)]
    workers: u32,
    /// Requests for --orchestrator.
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Chunks for the overlap figure (--connector).
    #[arg(long, default_value_t = 8)]
    chunks: u32,
    /// Op sizes, comma-separated (4096, 64K, 16M, 1G).
    #[arg(long, default_value = "4K,64K,1M,4M,16M,64M,256M,1G", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Which ops (write = put_from, read = get_into with --store).
    #[arg(long, value_enum, default_value = "both")]
    op: OpArg,
    /// The tcp baseline (the socket pair) arms the process's linger where the engine does (when
    /// it starts an op and when it serves one), so both keep their workers awake alike; its lines
    /// say "tokio-socket-lingering". Without it, the pair is plain and parks its workers
    /// between ops, as a plain tokio program does.
    #[arg(long)]
    linger_baseline: bool,
    /// Streams per connection (tcp), for tensorwire and the baseline alike.
    #[arg(long, default_value_t = tensorwire_tcp::default_streams())]
    streams: usize,
    /// Interleaved runs per measurement; lines report medians.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Which thread makes the calls: a runtime task (the default) or a thread outside the
    /// runtime (what a Python call is); the raw side runs on the same thread.
    #[arg(long, value_enum, default_value = "task")]
    caller: Caller,
    /// Minimum time per timed sample, in milliseconds.
    #[arg(long, default_value_t = 200)]
    min_time_ms: u64,
}

fn plan(args: &Args, budget: Budget) -> Plan {
    Plan {
        runs: args.runs,
        budget,
        streams: args.streams,
        chunks: args.chunks,
        page_offset: args.page_offset,
        prepared: args.prepared,
    }
}

/// Prints one JSON line.
fn print_json(v: &impl serde::Serialize) {
    match serde_json::to_string(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("xfer: cannot write a line: {e}"),
    }
}

fn emit(l: &Line) {
    l.emit();
}

/// One measurement of tensorwire against the raw medium for each (size, op).
async fn transfers(args: &Args, sizes: &[u64], ops: &[bool], budget: Budget) -> Result<Vec<Line>> {
    suite::transfers(&args.backend, sizes, ops, plan(args, budget), &emit).await
}

/// put_from / get_into against memcpy (embedded) or a raw engine transfer (remote).
async fn store(
    mode: StoreMode,
    args: &Args,
    sizes: &[u64],
    ops: &[bool],
    budget: Budget,
) -> Result<Vec<Line>> {
    suite::store(mode, sizes, ops, plan(args, budget), &emit).await
}

/// publish + consume against a raw engine READ, then the overlap figure.
async fn connector(args: &Args, sizes: &[u64], budget: Budget) -> Result<Vec<Line>> {
    let (lines, overlaps) = suite::connector(sizes, plan(args, budget), &emit).await?;
    for o in overlaps {
        eprintln!(
            "overlap {} in {} chunks: transfer {:.1} ms, decode {:.1} ms ({:.2} ms/chunk): last chunk decoded at {:.1} ms; max(transfer, decode) + one chunk = {:.1} ms; ratio {:.3} (median of {} trials; serial would be {:.1} ms)",
            fmt_size(o.size),
            o.chunks,
            o.transfer_ms,
            o.decode_ms,
            o.chunk_decode_ms,
            o.last_decoded_ms,
            o.ideal_ms,
            o.ratio,
            o.trial_ratios.len(),
            o.serial_ms
        );
        println!("{}", serde_json::to_string(&o).map_err(|e| Error::protocol(e.to_string()))?);
    }
    Ok(lines)
}

async fn run(args: Args) -> Result<()> {
    if args.scale {
        use tensorwire_benches::scale::{self, Limits};
        let limits = if args.scale_limits == "smoke" { Limits::smoke() } else { Limits::full() };
        let curves = scale::all(&limits, &|p| print_json(p)).await?;
        for c in &curves {
            eprintln!(
                "scale {}: {} -> {}: per op {:.2} -> {:.2} us, growth {:.2}x{}",
                c.curve,
                c.points.first().map_or(0, |p| p.x),
                c.points.last().map_or(0, |p| p.x),
                c.points.first().map_or(0.0, |p| p.per_op_us),
                c.points.last().map_or(0.0, |p| p.per_op_us),
                c.growth,
                if c.within_target { "" } else { " (over the 1.5x target)" }
            );
            print_json(c);
        }
        return Ok(());
    }
    if args.orchestrator {
        let in_flight = u64::from(args.workers) * 2;
        use tensorwire_benches::orchestrator::{run as core, run_reuse};
        for f in [
            core(args.workers, args.requests, in_flight),
            run_reuse(args.workers, args.requests, in_flight),
        ] {
            eprintln!(
                "orchestrator ({}): {} workers, {} requests, {} decisions in {:.2} s: {:.0} decisions/s; dispatch call p50 {:.1} us, p99 {:.1} us; cache hits {}, preemption asks {}, yields {}",
                f.mode,
                f.workers,
                f.requests,
                f.decisions,
                f.seconds,
                f.decisions_per_s,
                f.p50_dispatch_us,
                f.p99_dispatch_us,
                f.cache_hits,
                f.preempt_asks,
                f.yielded
            );
            println!("{}", serde_json::to_string(&f).map_err(|e| Error::protocol(e.to_string()))?);
        }
        return Ok(());
    }
    let mut sizes = Vec::new();
    for s in &args.sizes {
        let n = parse_size(s)
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("--sizes: cannot read {s:?}")))?;
        sizes.push(n);
    }
    let ops: Vec<bool> = match args.op {
        OpArg::Read => vec![false],
        OpArg::Write => vec![true],
        OpArg::Both => vec![true, false],
    };
    if args.latency {
        let mut sizes = Vec::new();
        for s in &args.latency_sizes {
            sizes.push(parse_size(s).filter(|&n| n > 0).ok_or_else(|| {
                Error::InvalidArgument(format!("--latency-sizes: cannot read {s:?}"))
            })?);
        }
        let lines = tensorwire_benches::latency::run(
            &args.backend,
            args.streams,
            &sizes,
            &ops,
            args.samples.max(1),
        )
        .await?;
        for l in lines {
            eprintln!(
                "latency {} {} {}: p50 {:.1} us, p99 {:.1} us; {}: p50 {:.2} us, p99 {:.2} us",
                l.backend,
                l.op,
                fmt_size(l.size),
                l.p50_us,
                l.p99_us,
                l.raw,
                l.raw_p50_us,
                l.raw_p99_us
            );
            println!("{}", serde_json::to_string(&l).map_err(|e| Error::protocol(e.to_string()))?);
        }
        return Ok(());
    }
    if args.cluster_store {
        let lines =
            tensorwire_benches::cluster::throughput(&sizes, args.clients, args.objects, args.runs)
                .await?;
        for l in &lines {
            println!("{}", serde_json::to_string(l).map_err(|e| Error::protocol(e.to_string()))?);
        }
        let size = sizes.iter().copied().min().unwrap_or(1 << 20);
        let r = tensorwire_benches::cluster::repair(args.objects * 8, size).await?;
        eprintln!(
            "cluster repair: {} objects of {} (2 replicas, 3 nodes), one node killed: {} copies in {} rounds, {:.2} s ({:.2} GB/s)",
            r.objects,
            fmt_size(r.size),
            r.copied,
            r.rounds,
            r.seconds,
            r.gbps
        );
        println!("{}", serde_json::to_string(&r).map_err(|e| Error::protocol(e.to_string()))?);
        return Ok(());
    }
    let budget = Budget { min_time: Duration::from_millis(args.min_time_ms), ..Budget::default() };
    let started = Instant::now();
    let (name, lines) = match args.store {
        _ if args.device => {
            let plan = plan(&args, budget);
            let lines =
                tensorwire_benches::suite::device_vs_host(&args.backend, &sizes, &ops, plan, &emit)
                    .await?;
            (format!("{}-device", args.backend), lines)
        }
        _ if args.batch > 0 => {
            let plan = plan(&args, budget);
            let lines = tensorwire_benches::suite::batches(
                &args.backend,
                &sizes,
                args.batch,
                &ops,
                plan,
                &emit,
            )
            .await?;
            (format!("{}-batch", args.backend), lines)
        }
        _ if args.copy => {
            let lines =
                tensorwire_benches::copy::run(&sizes, &args.distances, args.runs, budget, &emit)
                    .await?;
            ("copy".to_string(), lines)
        }
        _ if args.connector => {
            ("connector-p2p".to_string(), connector(&args, &sizes, budget).await?)
        }
        Some(mode) => {
            (format!("store-{}", mode.name()), store(mode, &args, &sizes, &ops, budget).await?)
        }
        None => (args.backend.clone(), transfers(&args, &sizes, &ops, budget).await?),
    };
    let ratios: Vec<f64> = lines.iter().map(|l| l.ratio).collect();
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let worst = lines
        .iter()
        .filter(|l| l.ratio == min)
        .map(|l| format!("{}@{}", l.op, fmt_size(l.size)))
        .collect::<Vec<_>>()
        .join(",");
    let summary = Summary {
        summary: true,
        backend: name,
        measurements: lines.len(),
        min_ratio: min,
        median_ratio: (median(&ratios) * 1000.0).round() / 1000.0,
        worst,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        seconds: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
    };
    println!("{}", serde_json::to_string(&summary).map_err(|e| Error::protocol(e.to_string()))?);
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    tensorwire_benches::raw_tcp::set_linger(args.linger_baseline);
    if args.metrics {
        if let Err(e) = tensorwire_observe::install("xfer") {
            eprintln!("xfer: {e}");
            return ExitCode::FAILURE;
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("xfer: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // By default, measure from a runtime task, not from `block_on`'s thread: completions then
    // wake a worker that is already running, as in a server, instead of a parked foreign thread.
    let r = rt.block_on(async {
        match tensorwire_benches::child_peer::serve_if_asked().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(e),
        }
        match args.caller {
            Caller::Task => {
                tokio::spawn(run(args)).await.unwrap_or_else(|e| Err(e.to_string().into()))
            }
            Caller::Blocking => run(args).await,
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xfer: {e}");
            ExitCode::FAILURE
        }
    }
}
