//! `tensorwire bench`: the bench harness's measurements for every backend on this machine (tcp,
//! shm, mem), the store (embedded and remote), the connector (handoff and overlap) and a short
//! demo (TTFF colocated vs disaggregated), written to a report directory: `report.md` with the
//! tables and SVG plots of GB/s against size per backend (with its baseline) and of the TTFF
//! distributions, then the RFC's four benchmarks: (a) colocated vs disaggregated throughput and
//! TTFF per layout and (c) the decode-pool sharing ratio from the capacity model, (b) overlap
//! efficiency and (d) connector overhead from the measurements.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use tensorwire_benches::measure::{Budget, fmt_size, parse_size};
use tensorwire_benches::report::Line;
use tensorwire_benches::store::StoreMode;
use tensorwire_benches::suite::{self, Plan};

use crate::demo::{DemoArgs, MixArgs};
use crate::plot::{Chart, PALETTE, Series};

/// `bench` options.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Report directory (created).
    #[arg(long, default_value = "tensorwire-report")]
    pub(crate) out: PathBuf,
    /// Transfer sizes.
    #[arg(long, value_delimiter = ',', default_value = "64K,1M,16M,64M")]
    pub(crate) sizes: Vec<String>,
    /// Interleaved runs per measurement.
    #[arg(long, default_value_t = 3)]
    pub(crate) runs: usize,
    /// Minimum time per sample, ms.
    #[arg(long, default_value_t = 100)]
    pub(crate) min_time_ms: u64,
    /// The scale curves' counts: `smoke` (small, a few seconds), `full` (the counts issue 39
    /// names, minutes and about 7 GB of memory), or `none`.
    #[arg(long, default_value = "smoke", value_parser = ["none", "smoke", "full"])]
    pub(crate) scale: String,
}

fn progress(l: &Line) {
    let (what, op, size) = (&l.backend, &l.op, fmt_size(l.size));
    let (tw, base, base_gbps, r) = (l.gbps, &l.baseline, l.baseline_gbps, l.ratio);
    eprintln!(
        "  {what:<15} {op:>15} {size:>7}: {tw:>7.3} GB/s vs {base} {base_gbps:>7.3} GB/s, ratio {r:.3}"
    );
}

fn table(out: &mut String, lines: &[Line]) {
    let _ =
        writeln!(out, "| what | op | size | tensorwire GB/s | baseline | baseline GB/s | ratio |");
    let _ =
        writeln!(out, "|------|----|------|-----------------|----------|---------------|-------|");
    for l in lines {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.3} | {} | {:.3} | {:.3} |",
            l.backend,
            l.op,
            fmt_size(l.size),
            l.gbps,
            l.baseline,
            l.baseline_gbps,
            l.ratio
        );
    }
    let _ = writeln!(out);
}

fn size_label(x: f64) -> String {
    fmt_size(x as u64).replace("iB", "")
}

fn ms_label(x: f64) -> String {
    format!("{x:.0}")
}

fn gbps_chart(name: &str, lines: &[Line]) -> Chart {
    let mut series = Vec::new();
    // One pair of series per (what, op): lines of two processes ("shm-2p", "tcp-2p") apart.
    let ops: Vec<(String, String)> = {
        let mut v: Vec<(String, String)> =
            lines.iter().map(|l| (l.backend.clone(), l.op.clone())).collect();
        v.sort();
        v.dedup();
        v
    };
    for (i, (what, op)) in ops.iter().enumerate() {
        let pick: Vec<&Line> = lines.iter().filter(|l| &l.op == op && &l.backend == what).collect();
        let base = pick.first().map_or(String::new(), |l| l.baseline.clone());
        let who = if what == name { String::new() } else { format!(" ({what})") };
        series.push(Series {
            name: format!("tensorwire{who} {op}"),
            color: PALETTE[(2 * i) % PALETTE.len()],
            points: pick.iter().map(|l| (l.size as f64, l.gbps)).collect(),
            dashed: false,
        });
        series.push(Series {
            name: format!("{base}{who} {op}"),
            color: PALETTE[(2 * i + 1) % PALETTE.len()],
            points: pick.iter().map(|l| (l.size as f64, l.baseline_gbps)).collect(),
            dashed: true,
        });
    }
    Chart {
        title: format!("{name}: GB/s against size"),
        x_label: "bytes per op".into(),
        y_label: "GB/s".into(),
        log_x: true,
        x_fmt: size_label,
        series,
        y_max: None,
    }
}

/// Workloads of benchmark (a): (name, `simulate` arguments).
const LAYOUT_WORKLOADS: [(&str, &[&str]); 2] = [
    (
        "memory-bound: Qwen-Image-2512 (8 steps) on 8 RTX 4090",
        &["--plan", "--gpus", "8", "--plan-classes", "rtx4090", "--model", "qwen-image-2512-8step"],
    ),
    (
        "fits: Wan2.1-1.3B, FLUX.1-dev, Qwen-Image on 8 H200",
        &[
            "--plan",
            "--gpus",
            "8",
            "--plan-classes",
            "h200",
            "--mix",
            "wan2.1-t2v-1.3b-480p,flux.1-dev-1024,qwen-image-1328",
        ],
    ),
];

/// The RFC's four benchmarks: (a) and (c) from the capacity model (the orchestrator's
/// scheduler in simulated time), (b) and (d) from the measurements above.
fn rfc_benchmarks(
    md: &mut String,
    out: &std::path::Path,
    plots: &mut Vec<String>,
    conn: &[Line],
    overlaps: &[tensorwire_benches::connector::Overlap],
) -> anyhow::Result<()> {
    let _ = writeln!(md, "\n## The RFC's four benchmarks\n");
    let _ = writeln!(
        md,
        "### (a) Throughput and p99 TTFF, colocated vs disaggregated\n\nFrom `tensorwire simulate --plan` (stage times from the capacity model: profiles, GPU classes, memory fit; every dispatch by the orchestrator's scheduler; capacity with 2,000 requests queued at once, TTFF under Poisson arrivals at 70% of the least capacity shown). The demo above measures the memory-bound case through the real engine.\n"
    );
    for (i, (name, args)) in LAYOUT_WORKLOADS.iter().enumerate() {
        eprintln!("bench: simulate --plan ({name})");
        let mut all = args.to_vec();
        all.extend(["--requests", "2000"]);
        let (rows, rate, _) = crate::simulate::plan_figures(&all)?;
        let _ = writeln!(md, "**{name}** (`tensorwire simulate {}`)\n", args.join(" "));
        let _ = writeln!(
            md,
            "| layout | GPUs | $/h | capacity req/s | p99 TTFF s | $/1k requests | what decided |\n|---|---|---|---|---|---|---|"
        );
        for r in &rows {
            let _ = writeln!(
                md,
                "| `{}` | {} | {:.2} | {:.4} | {:.1} | {:.2} | {} |",
                r.layout.replace('|', "\\|"),
                r.gpus,
                r.usd_per_hour,
                r.capacity,
                r.ttff_p99_s,
                r.usd_per_hour / (r.capacity * 3.6).max(1e-12),
                r.why
            );
        }
        let colo = rows.iter().find(|r| r.colocated);
        let best =
            rows.iter().filter(|r| !r.colocated).max_by(|x, y| x.capacity.total_cmp(&y.capacity));
        if let (Some(c), Some(d)) = (colo, best) {
            let _ = writeln!(
                md,
                "\nBest disaggregated `{}` vs colocated `{}` at equal GPU count: throughput {:.2}x, p99 TTFF {:.1} s vs {:.1} s.\n",
                d.layout,
                c.layout,
                d.capacity / c.capacity.max(1e-12),
                d.ttff_p99_s,
                c.ttff_p99_s
            );
        }
        let file = format!("layouts-{}.svg", i + 1);
        crate::simulate::plot_layouts(&out.join(&file), &rows, rate)?;
        let _ = writeln!(md, "![layouts]({file})\n");
        plots.push(file);
    }
    let _ = writeln!(md, "### (b) Overlap efficiency\n");
    for o in overlaps {
        let _ = writeln!(
            md,
            "- {}: the last chunk decoded {:.3} x the bound max(transfer, decode) + one chunk (Connector section).",
            fmt_size(o.size),
            o.ratio
        );
    }
    let _ = writeln!(md, "\n### (c) Decode-pool sharing ratio N:M meeting a TTFF SLO\n");
    let args = [
        "--sweep",
        "--model",
        "wan2.1-t2v-1.3b-480p",
        "--denoise",
        "40",
        "--target-ttff-ms",
        "120000",
        "--requests",
        "5000",
    ];
    eprintln!("bench: simulate --sweep");
    let crate::simulate::SweepFigures { points: pts, chosen, target_s: target, rate } =
        crate::simulate::sweep_figures(&args)?;
    let _ = writeln!(
        md,
        "`tensorwire simulate {}`: 40 denoise workers at {rate:.4} req/s (90% of what they sustain).\n\n| decode workers | p99 TTFF s |\n|---|---|",
        args.join(" ")
    );
    for (m, p99) in &pts {
        let _ = writeln!(md, "| {m} | {p99:.1} |");
    }
    let _ = writeln!(
        md,
        "\n{}\n",
        chosen.map_or(format!("No decode pool meets p99 TTFF <= {target:.0} s."), |(n, m)| {
            format!(
                "Chosen N:M = {n}:{m}: the smallest decode pool with p99 TTFF <= {target:.0} s."
            )
        })
    );
    let chart = Chart {
        title: format!("p99 TTFF by decode pool size (SLO {target:.0} s, dashed)"),
        x_label: "decode workers".into(),
        y_label: "p99 TTFF, s".into(),
        log_x: false,
        x_fmt: |x| format!("{x:.0}"),
        series: vec![
            Series {
                name: "p99 TTFF".into(),
                color: PALETTE[0],
                points: pts.iter().map(|&(m, p)| (f64::from(m), p)).collect(),
                dashed: false,
            },
            Series {
                name: "SLO".into(),
                color: PALETTE[3],
                points: pts.iter().map(|&(m, _)| (f64::from(m), target)).collect(),
                dashed: true,
            },
        ],
        y_max: None,
    };
    chart.save(&out.join("sweep.svg"))?;
    let _ = writeln!(md, "![sweep](sweep.svg)\n");
    plots.push("sweep.svg".into());
    let _ = writeln!(md, "### (d) Connector overhead vs a raw transfer\n");
    for l in conn {
        let _ = writeln!(
            md,
            "- {} {}: {:.3} GB/s vs {} {:.3} GB/s, ratio {:.3} (Connector section).",
            l.op,
            fmt_size(l.size),
            l.gbps,
            l.baseline,
            l.baseline_gbps,
            l.ratio
        );
    }
    Ok(())
}

/// Runs the benches and writes the report.
pub(crate) async fn run(a: BenchArgs) -> anyhow::Result<()> {
    // Re-run as the peer of a two-process measurement (shm between processes): serve, then stop.
    if tensorwire_benches::child_peer::serve_if_asked().await.map_err(anyhow::Error::msg)? {
        return Ok(());
    }
    let mut sizes = Vec::new();
    for s in &a.sizes {
        sizes.push(
            parse_size(s)
                .filter(|&n| n > 0)
                .ok_or_else(|| anyhow::anyhow!("--sizes: cannot read {s:?}"))?,
        );
    }
    if sizes.is_empty() || a.runs == 0 {
        return Err(anyhow::Error::msg("--sizes and --runs must not be empty or zero"));
    }
    std::fs::create_dir_all(&a.out).map_err(|e| anyhow::anyhow!("{}: {e}", a.out.display()))?;
    let plan = Plan {
        runs: a.runs,
        budget: Budget { min_time: Duration::from_millis(a.min_time_ms), ..Budget::default() },
        streams: tensorwire_tcp::default_streams(),
        chunks: 8,
        page_offset: 0,
        prepared: false,
    };
    let mut md = String::new();
    let _ = writeln!(md, "# tensorwire bench report\n");
    let _ = writeln!(
        md,
        "Machine: {} cores. Every line is the median of {} runs of tensorwire and its baseline measured in the same process run, taking turns within each run (tcp: a plain tokio socket pair with the same streams; shm and mem: memcpy; store: memcpy or a raw tcp engine transfer; connector: a raw engine READ). Ratio = the median of each run's tensorwire / baseline.\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a.runs
    );
    let mut plots = Vec::new();
    for backend in ["tcp", "shm", "mem"] {
        eprintln!("bench: {backend}");
        let lines = suite::transfers(backend, &sizes, &[true, false], plan, &progress)
            .await
            .map_err(anyhow::Error::msg)?;
        let _ = writeln!(md, "## Backend `{backend}`\n");
        table(&mut md, &lines);
        let file = format!("backend-{backend}.svg");
        gbps_chart(backend, &lines).save(&a.out.join(&file))?;
        let _ = writeln!(
            md,
            "![{backend}]({file})\n\nSolid: tensorwire; dashed: the baseline; one colour pair per op.\n"
        );
        plots.push(file);
    }
    eprintln!("bench: copy");
    let copy = tensorwire_benches::copy::run(
        &[4 << 10, 64 << 10, 256 << 10],
        &[0, 16],
        plan.runs,
        plan.budget,
        &progress,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let _ = writeln!(
        md,
        "## The memory backends' copy\n\nThe CPU copy of shm, mem and UCX's mapped path (`copy_bytes`) against the C library's memcpy of the same bytes, the destination 0 and 16 bytes further into its page than the source (16: a READ into a buffer from `malloc`, which starts 16 bytes into its page). glibc's memcpy crawls on AMD CPUs at distances of 1-63 bytes for copies of 2 KiB to 1 MiB; `copy_bytes` takes a vector loop there.\n"
    );
    table(&mut md, &copy);
    let store_sizes: Vec<u64> = sizes.iter().copied().filter(|&s| s >= 1 << 20).collect();
    let store_sizes = if store_sizes.is_empty() { sizes.clone() } else { store_sizes };
    let _ = writeln!(md, "## Store\n");
    let mut store_lines = Vec::new();
    for mode in [StoreMode::Embedded, StoreMode::Remote] {
        eprintln!("bench: store {}", mode.name());
        store_lines.extend(
            suite::store(mode, &store_sizes, &[true, false], plan, &progress)
                .await
                .map_err(anyhow::Error::msg)?,
        );
    }
    table(&mut md, &store_lines);
    eprintln!("bench: connector");
    let csizes = [4u64 << 20, 64 << 20];
    let (conn, overlaps) =
        suite::connector(&csizes, plan, &progress).await.map_err(anyhow::Error::msg)?;
    let _ = writeln!(md, "## Connector (p2p over tcp)\n");
    table(&mut md, &conn);
    let _ = writeln!(
        md,
        "Overlap: a payload in {} chunks, each landed chunk decoded by a sleep of one eighth of the transfer (the bound uses the measured sleeps); target last-decoded <= 1.15 x (max(transfer, decode) + one chunk).\n",
        plan.chunks
    );
    let _ = writeln!(
        md,
        "| size | transfer ms | decode ms | last decoded ms | bound ms | ratio |\n|---|---|---|---|---|---|"
    );
    for o in &overlaps {
        let _ = writeln!(
            md,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.3} |",
            fmt_size(o.size),
            o.transfer_ms,
            o.decode_ms,
            o.last_decoded_ms,
            o.ideal_ms,
            o.ratio
        );
    }
    let _ = writeln!(md);
    eprintln!("bench: demo (TTFF)");
    let demo = DemoArgs {
        mix: MixArgs { models: None, profiles: None, gpus: 8, split: None, time_scale: 0.02 },
        scenario: "memory-bound".into(),
        requests: 24,
        prompts: 6,
        processes: false,
        chaos: None,
        seed: 1,
        checkpoint_every: 0,
        metrics: Default::default(),
        store: crate::demo::procs::StoreArgs { store_nodes: 0, replicas: 2, chaos_store: None },
    };
    let (d, c) = crate::demo::compare(&demo).await?;
    let cdf = |v: &[Duration]| -> Vec<(f64, f64)> {
        let mut s: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        s.sort_by(f64::total_cmp);
        let n = s.len().max(1) as f64;
        s.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect()
    };
    let chart = Chart {
        title: "TTFF distribution (demo, time scale 0.02)".into(),
        x_label: "time to first decoded frame, ms".into(),
        y_label: "share of requests".into(),
        log_x: false,
        x_fmt: ms_label,
        series: vec![
            Series {
                name: format!("disaggregated {}", d.layout.split(' ').next().unwrap_or("")),
                color: PALETTE[0],
                points: cdf(&d.ttff),
                dashed: false,
            },
            Series {
                name: "colocated".into(),
                color: PALETTE[1],
                points: cdf(&c.ttff),
                dashed: false,
            },
        ],
        y_max: Some(1.0),
    };
    chart.save(&a.out.join("ttff.svg"))?;
    plots.push("ttff.svg".into());
    let p = |v: &[Duration], q: f64| crate::report::percentile(v, q).as_secs_f64() * 1e3;
    let _ = writeln!(
        md,
        "## TTFF: disaggregated vs colocated\n\nThe demo's workload ({} requests, 8 simulated GPUs, service times x{}): disaggregated {} vs colocated.\n",
        demo.requests, demo.mix.time_scale, d.layout
    );
    let _ = writeln!(
        md,
        "| layout | TTFF p50 ms | TTFF p99 ms | throughput req/s |\n|---|---|---|---|"
    );
    for (name, s) in [("disaggregated", &d), ("colocated", &c)] {
        let _ = writeln!(
            md,
            "| {name} | {:.0} | {:.0} | {:.2} |",
            p(&s.ttff, 50.0),
            p(&s.ttff, 99.0),
            s.requests as f64 / s.elapsed.as_secs_f64()
        );
    }
    let _ = writeln!(
        md,
        "\n![TTFF](ttff.svg)\n\nCumulative share of requests whose first frame was decoded by a given time."
    );
    rfc_benchmarks(&mut md, &a.out, &mut plots, &conn, &overlaps)?;
    if a.scale != "none" {
        use tensorwire_benches::scale::Limits;
        let limits = if a.scale == "full" { Limits::full() } else { Limits::smoke() };
        crate::scale_report::section(&mut md, &a.out, &mut plots, &limits, &a.scale).await?;
    }
    let path = a.out.join("report.md");
    std::fs::write(&path, md).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    println!("wrote {} and {} plots ({})", path.display(), plots.len(), plots.join(", "));
    Ok(())
}
