//! `xfer`: tensorwire transfers against the raw medium, interleaved in one run.
//!
//! ```text
//! cargo run --release -p tensorwire-benches --bin xfer -- --backend tcp --sizes 64M,256M --runs 5
//! ```
//! Prints one JSON line per (op, size) with the medians of `--runs` interleaved runs, then a
//! summary line. Progress goes to stderr.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use tensorwire_benches::measure::{Budget, fmt_size, gbps, median, parse_size};
use tensorwire_benches::memcpy::Memcpy;
use tensorwire_benches::raw_tcp::RawTcp;
use tensorwire_benches::report::{Line, Summary};
use tensorwire_benches::transfer::{BACKENDS, EnginePair};
use tensorwire_core::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OpArg {
    Read,
    Write,
    Both,
}

/// Measure tensorwire transfers against the raw medium (tcp: a plain tokio socket pair with the
/// same stream count; shm and mem: memcpy in one process), interleaved, one JSON line per
/// measurement.
#[derive(Debug, Parser)]
#[command(name = "xfer")]
struct Args {
    /// Backend to measure.
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Op sizes, comma-separated (4096, 64K, 16M, 1G).
    #[arg(long, default_value = "4K,64K,1M,4M,16M,64M,256M,1G", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Which ops.
    #[arg(long, value_enum, default_value = "both")]
    op: OpArg,
    /// Streams per connection (tcp), for tensorwire and the baseline alike.
    #[arg(long, default_value_t = tensorwire_tcp::default_streams())]
    streams: usize,
    /// Interleaved runs per measurement; lines report medians.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Minimum time per timed sample, in milliseconds.
    #[arg(long, default_value_t = 200)]
    min_time_ms: u64,
}

enum Baseline {
    Tcp(RawTcp),
    Memcpy(Memcpy),
}

impl Baseline {
    fn name(&self) -> &'static str {
        match self {
            Baseline::Tcp(_) => "tokio-socket",
            Baseline::Memcpy(_) => "memcpy",
        }
    }

    async fn gbps(&mut self, write: bool, size: u64, budget: Budget) -> Result<f64> {
        match self {
            Baseline::Tcp(raw) => {
                // The closure re-borrows `raw` per iteration (uncontended lock).
                let raw = tokio::sync::Mutex::new(raw);
                gbps(budget, size, || async { raw.lock().await.op(write, size).await }).await
            }
            Baseline::Memcpy(m) => Ok(m.gbps(size, budget)),
        }
    }
}

async fn run(args: Args) -> Result<()> {
    if !BACKENDS.contains(&args.backend.as_str()) {
        return Err(Error::InvalidArgument(format!(
            "--backend {}: this harness knows {BACKENDS:?}",
            args.backend
        )));
    }
    let mut sizes = Vec::new();
    for s in &args.sizes {
        let n = parse_size(s)
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("--sizes: cannot read {s:?}")))?;
        sizes.push(n);
    }
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let streams = if args.backend == "tcp" { args.streams.max(1) } else { 1 };
    let ops: Vec<bool> = match args.op {
        OpArg::Read => vec![false],
        OpArg::Write => vec![true],
        OpArg::Both => vec![true, false],
    };
    let budget = Budget { min_time: Duration::from_millis(args.min_time_ms), ..Budget::default() };
    let runs = args.runs.max(1);
    let started = Instant::now();

    let pair = EnginePair::new(&args.backend, streams, max).await?;
    let mut base = match args.backend.as_str() {
        "tcp" => Baseline::Tcp(RawTcp::new(streams, max).await?),
        _ => Baseline::Memcpy(Memcpy::new(max)),
    };
    let mut lines = Vec::new();
    for &size in &sizes {
        for &write in &ops {
            let (mut tw, mut raw) = (Vec::new(), Vec::new());
            for run in 0..runs {
                // Alternate which goes first, so neither always gets the warmer caches.
                if run % 2 == 0 {
                    raw.push(base.gbps(write, size, budget).await?);
                    tw.push(gbps(budget, size, || pair.op(write, size, &args.backend)).await?);
                } else {
                    tw.push(gbps(budget, size, || pair.op(write, size, &args.backend)).await?);
                    raw.push(base.gbps(write, size, budget).await?);
                }
            }
            let (g, b) = (median(&tw), median(&raw));
            let line = Line {
                backend: args.backend.clone(),
                op: if write { "write" } else { "read" }.into(),
                size,
                streams,
                gbps: g,
                baseline: base.name().into(),
                baseline_gbps: b,
                ratio: if b > 0.0 { g / b } else { 0.0 },
                runs,
                samples: tw,
                baseline_samples: raw,
            }
            .rounded();
            eprintln!(
                "{:>5} {:>7}: tensorwire {:>7.3} GB/s   {} {:>7.3} GB/s   ratio {:.3}",
                line.op,
                fmt_size(size),
                line.gbps,
                line.baseline,
                line.baseline_gbps,
                line.ratio
            );
            println!(
                "{}",
                serde_json::to_string(&line).map_err(|e| Error::protocol(e.to_string()))?
            );
            lines.push(line);
        }
    }
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
        backend: args.backend.clone(),
        measurements: lines.len(),
        min_ratio: min,
        median_ratio: (median(&ratios) * 1000.0).round() / 1000.0,
        worst,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        seconds: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
    };
    println!("{}", serde_json::to_string(&summary).map_err(|e| Error::protocol(e.to_string()))?);
    pair.a.shutdown().await;
    pair.b.shutdown().await;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("xfer: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Measure from a runtime task, not from `block_on`'s thread: completions then wake a worker
    // that is already running, as in a server, instead of a parked foreign thread.
    let r = rt.block_on(async {
        tokio::spawn(run(args)).await.unwrap_or_else(|e| Err(Error::protocol(e.to_string())))
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xfer: {e}");
            ExitCode::FAILURE
        }
    }
}
