//! `tensorwire soak`: the demo's pipeline of worker processes under steady load (batches of
//! requests back to back) with chaos on, for N minutes. At every sample it records the parent's
//! resident memory, open descriptors and memfds (the parent runs the store node and the
//! orchestrator), the workers' memory and descriptors, and the store's objects and bytes once the
//! batch's releases have landed. It fails if a request is lost or if any of the parent's figures
//! or the store's ends well above where it stood after the first sample (growth without bound).

use std::time::{Duration, Instant};

use clap::Args;

use crate::demo::MixArgs;
use crate::demo::procs::{Cluster, ClusterArgs};

/// `tensorwire soak` arguments.
#[derive(Debug, Args)]
pub(crate) struct SoakArgs {
    /// How long to run.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) sample_secs: f64,
    /// Kill a random worker about every SECS seconds (0 for none).
    #[arg(long, default_value_t = 2.0, value_name = "SECS")]
    pub(crate) chaos: f64,
    /// Seed of the kills.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Requests per batch (submitted together; the next batch starts when all have ended).
    #[arg(long, default_value_t = 24)]
    pub(crate) batch: u64,
    /// The mix and the pools.
    #[command(flatten)]
    pub(crate) mix: MixArgs,
    /// The store: one node, or store node processes (killed too, with --chaos-store).
    #[command(flatten)]
    pub(crate) store: crate::demo::procs::StoreArgs,
}

/// One sample.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    at: Duration,
    requests: u64,
    lost: u64,
    rss: u64,
    fds: u64,
    memfds: u64,
    worker_rss: u64,
    worker_fds: u64,
    objects: u64,
    bytes: u64,
}

/// Resident bytes, open descriptors and memfds of process `pid`.
fn usage(pid: &str) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    let (mut fds, mut memfds) = (0, 0);
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in dir.flatten() {
            fds += 1;
            let target = std::fs::read_link(e.path()).unwrap_or_default();
            memfds += u64::from(target.to_string_lossy().starts_with("/memfd:"));
        }
    }
    (kib << 10, fds, memfds)
}

/// Runs `soak`.
pub(crate) async fn run(a: SoakArgs) -> anyhow::Result<()> {
    if !(a.minutes > 0.0 && a.minutes <= 24.0 * 60.0) {
        return Err(anyhow::anyhow!("--minutes {}: must be in (0, 1440]", a.minutes));
    }
    if !(a.sample_secs >= 1.0 && a.sample_secs <= 3600.0) {
        return Err(anyhow::anyhow!("--sample-secs {}: must be in [1, 3600]", a.sample_secs));
    }
    if a.chaos != 0.0 && !(0.05..=3600.0).contains(&a.chaos) {
        return Err(anyhow::anyhow!("--chaos {}: 0 (none) or 0.05..=3600 seconds", a.chaos));
    }
    if a.batch == 0 || a.batch > 10_000 {
        return Err(anyhow::anyhow!("--batch {}: must be in 1..=10000", a.batch));
    }
    let (models, split) = a.mix.resolve(&crate::demo::DEFAULT_MIX)?;
    let ca = ClusterArgs {
        time_scale: a.mix.time_scale,
        profiles: a.mix.profiles.clone(),
        chaos: (a.chaos > 0.0).then_some(a.chaos),
        seed: a.seed,
        checkpoint_every: 10,
        metrics: crate::observe::MetricsArgs::default(),
        rebalance: None,
        store: a.store.layout(a.seed, crate::demo::pipeline::STORE_BYTES)?,
    };
    println!(
        "tensorwire soak: {} min, batches of {} requests, {}:{}:{} worker processes, {}",
        a.minutes,
        a.batch,
        split.encode,
        split.denoise,
        split.decode,
        match (ca.chaos, ca.store.chaos) {
            (Some(s), None) => format!("a worker killed about every {s} s"),
            (Some(s), Some(n)) => {
                format!("a worker killed about every {s} s, a store node about every {n} s")
            }
            (None, Some(n)) => format!("a store node killed about every {n} s"),
            (None, None) => "no chaos".into(),
        }
    );
    let mut c = Cluster::start(&ca, &models, split).await?;
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.minutes * 60.0);
    let every = Duration::from_secs_f64(a.sample_secs);
    let mut next_sample = start;
    let (mut next, mut completed, mut lost, mut first_lost) = (0u64, 0u64, 0u64, None);
    let mut samples: Vec<Sample> = Vec::new();
    loop {
        let now = Instant::now();
        if now >= next_sample || now >= end {
            let st = c.settled_store().await?;
            let (rss, fds, memfds) = usage("self");
            let (mut worker_rss, mut worker_fds) = (0, 0);
            for pid in c.worker_pids() {
                let (r, f, _) = usage(&pid.to_string());
                worker_rss += r;
                worker_fds += f;
            }
            let s = Sample {
                at: now - start,
                requests: completed,
                lost,
                rss,
                fds,
                memfds,
                worker_rss,
                worker_fds,
                objects: st.objects,
                bytes: st.used,
            };
            print_row(&s, samples.is_empty());
            samples.push(s);
            next_sample += every;
        }
        if now >= end {
            break;
        }
        let (done, gone) = c.run(next..next + a.batch, Instant::now()).await?;
        next += a.batch;
        completed += done.len() as u64;
        lost += gone.len() as u64;
        if first_lost.is_none() {
            first_lost = gone.into_iter().next();
        }
        c.drain_lines(Duration::from_millis(1)).await; // decode workers' timing lines
    }
    let report = c.stop().await?;
    let last = samples.last().copied().unwrap_or_default();
    println!("{}", report.line(completed as usize, lost as usize, last.objects));
    if let Some(l) = &report.store {
        println!("{l}");
    }
    if let Some(e) = first_lost {
        return Err(anyhow::anyhow!("{lost} requests lost; first: {e}"));
    }
    check_bounded(&samples)
}

fn mib(b: u64) -> String {
    format!("{:.0}", b as f64 / (1 << 20) as f64)
}

fn print_row(s: &Sample, header: bool) {
    if header {
        println!(
            "{:>7} {:>9} {:>5} {:>8} {:>5} {:>7} {:>12} {:>11} {:>13} {:>11}",
            "minute",
            "requests",
            "lost",
            "RSS MiB",
            "fds",
            "memfds",
            "workers MiB",
            "worker fds",
            "store objects",
            "store MiB"
        );
    }
    println!(
        "{:>7.1} {:>9} {:>5} {:>8} {:>5} {:>7} {:>12} {:>11} {:>13} {:>11}",
        s.at.as_secs_f64() / 60.0,
        s.requests,
        s.lost,
        mib(s.rss),
        s.fds,
        s.memfds,
        mib(s.worker_rss),
        s.worker_fds,
        s.objects,
        mib(s.bytes)
    );
}

/// Each figure of the parent and the store at the last sample must stay within a margin of the
/// first sample taken under load (the second; the first is before any request).
fn check_bounded(samples: &[Sample]) -> anyhow::Result<()> {
    let (Some(base), Some(last)) = (samples.get(1), samples.last()) else {
        return Ok(()); // one sample: nothing to compare
    };
    type Figure = fn(&Sample) -> u64;
    let checks: [(&str, Figure, u64); 5] = [
        ("resident memory", |s| s.rss, 64 << 20),
        ("open descriptors", |s| s.fds, 16),
        ("memfds", |s| s.memfds, 4),
        ("store objects", |s| s.objects, 2),
        ("store bytes", |s| s.bytes, 64 << 20),
    ];
    let grew: Vec<String> = checks
        .iter()
        .filter(|(_, f, slack)| f(last) > f(base) + f(base) / 4 + slack)
        .map(|(what, f, _)| format!("{what}: {} then {}", f(base), f(last)))
        .collect();
    if grew.is_empty() {
        println!("soak: bounded (the last sample is within a quarter plus a margin of the second)");
        Ok(())
    } else {
        Err(anyhow::anyhow!("grew without bound: {}", grew.join("; ")))
    }
}
