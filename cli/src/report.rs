//! The demo's final table: disaggregated and colocated side by side.

use std::time::Duration;

/// What one layout did.
#[derive(Debug, Clone)]
pub(crate) struct Summary {
    /// Requests completed.
    pub(crate) requests: u64,
    /// Wall time of the run.
    pub(crate) elapsed: Duration,
    /// Time to first decoded frame (chunk) per request, from the burst's start.
    pub(crate) ttff: Vec<Duration>,
    /// End-to-end time per request, from the burst's start.
    pub(crate) e2e: Vec<Duration>,
    /// Busy share per stage pool (encode, denoise, decode), when pools exist.
    pub(crate) utilisation: Option<[f64; 3]>,
    /// Payload bytes the pipeline moved between stages.
    pub(crate) moved: u64,
    /// Bytes the engines counted for those moves (None when they live in other processes).
    pub(crate) engine_bytes: Option<u64>,
    /// Payload bytes over the time consumers spent receiving them.
    pub(crate) handoff_gbps: f64,
    /// Embedding cache hits.
    pub(crate) cache_hits: u64,
    /// Shared CFG-feature hits (None: not shared in this layout).
    pub(crate) cfg_hits: Option<u64>,
    /// Store objects left after the run.
    pub(crate) store_left: u64,
    /// The layout.
    pub(crate) layout: String,
    /// US$ per hour of its GPUs (0: not priced).
    pub(crate) usd_per_hour: f64,
    /// The run's service times over the profiled ones (`--time-scale`).
    pub(crate) time_scale: f64,
    /// Stages that run at another speed in this layout than in the other, one line each.
    pub(crate) differences: Vec<String>,
    /// The orchestrator's timeline of the slowest request, rendered (None: no orchestrator).
    pub(crate) slowest: Option<String>,
}

/// The `p`-th percentile (0..=100), nearest rank; zero for no samples.
pub(crate) fn percentile(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let mut s = v.to_vec();
    s.sort();
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 { format!("{:.2}x", a / b) } else { "-".into() }
}

/// A row with the `p`-th percentile of a latency of both runs and their ratio.
fn pct_row(
    label: &str,
    d: &Summary,
    c: &Summary,
    of: impl Fn(&Summary) -> &[Duration],
    p: f64,
) -> (String, String, String, String) {
    let (a, b) = (percentile(of(d), p), percentile(of(c), p));
    (label.into(), ms(a), ms(b), ratio(a.as_secs_f64(), b.as_secs_f64()))
}

/// Prints the side-by-side table.
pub(crate) fn print(d: &Summary, c: &Summary) {
    let thr = |s: &Summary| s.requests as f64 / s.elapsed.as_secs_f64().max(1e-9);
    let rows: Vec<(String, String, String, String)> = vec![
        ("layout".into(), d.layout.clone(), c.layout.clone(), String::new()),
        ("requests".into(), d.requests.to_string(), c.requests.to_string(), String::new()),
        (
            "wall time".into(),
            ms(d.elapsed),
            ms(c.elapsed),
            ratio(d.elapsed.as_secs_f64(), c.elapsed.as_secs_f64()),
        ),
        (
            "throughput (req/s)".into(),
            format!("{:.2}", thr(d)),
            format!("{:.2}", thr(c)),
            ratio(thr(d), thr(c)),
        ),
        pct_row("TTFF p50", d, c, |s| &s.ttff, 50.0),
        pct_row("TTFF p99", d, c, |s| &s.ttff, 99.0),
        pct_row("end-to-end p50", d, c, |s| &s.e2e, 50.0),
        pct_row("end-to-end p99", d, c, |s| &s.e2e, 99.0),
        (
            "utilisation enc/den/dec".into(),
            d.utilisation.map_or("-".into(), |u| {
                format!("{:.0}% / {:.0}% / {:.0}%", u[0] * 100.0, u[1] * 100.0, u[2] * 100.0)
            }),
            c.utilisation.map_or("-".into(), |u| {
                format!(
                    "{:.0}% / {:.0}% / {:.0}% of GPU time",
                    u[0] * 100.0,
                    u[1] * 100.0,
                    u[2] * 100.0
                )
            }),
            String::new(),
        ),
        (
            "bytes moved".into(),
            match d.engine_bytes {
                Some(b) => format!(
                    "{:.1} MiB (engines counted {:.1} MiB)",
                    d.moved as f64 / 1048576.0,
                    b as f64 / 1048576.0
                ),
                None => format!("{:.1} MiB (checked by the workers)", d.moved as f64 / 1048576.0),
            },
            "0 (no handoff)".into(),
            String::new(),
        ),
        (
            "handoff GB/s".into(),
            if d.handoff_gbps > 0.0 { format!("{:.2}", d.handoff_gbps) } else { "-".into() },
            "-".into(),
            String::new(),
        ),
        (
            "embedding cache hits".into(),
            d.cache_hits.to_string(),
            c.cache_hits.to_string(),
            String::new(),
        ),
        (
            "CFG feature hits".into(),
            d.cfg_hits.map_or("-".into(), |n| n.to_string()),
            c.cfg_hits.map_or("-".into(), |n| n.to_string()),
            String::new(),
        ),
        ("store objects left".into(), d.store_left.to_string(), "-".into(), String::new()),
        (
            "$ per 1k requests".into(),
            per_1k(d).map_or("-".into(), |x| format!("{x:.2} (${:.2}/h)", d.usd_per_hour)),
            per_1k(c).map_or("-".into(), |x| format!("{x:.2} (${:.2}/h)", c.usd_per_hour)),
            match (per_1k(d), per_1k(c)) {
                (Some(a), Some(b)) => ratio(a, b),
                _ => String::new(),
            },
        ),
    ];
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max("disaggregated".len());
    let w2 = rows.iter().map(|r| r.2.len()).max().unwrap_or(0).max("colocated".len());
    println!();
    println!("{:<w0$}  {:<w1$}  {:<w2$}  disagg/coloc", "", "disaggregated", "colocated");
    println!("{}", "-".repeat(w0 + w1 + w2 + 18));
    for (a, b, c, r) in rows {
        println!("{a:<w0$}  {b:<w1$}  {c:<w2$}  {r}");
    }
}

/// US$ per 1,000 requests at the run's throughput in GPU time (its wall time over its time
/// scale).
fn per_1k(s: &Summary) -> Option<f64> {
    (s.usd_per_hour > 0.0 && s.requests > 0).then(|| {
        let thr = s.requests as f64 * s.time_scale / s.elapsed.as_secs_f64().max(1e-9);
        s.usd_per_hour / (thr * 3.6)
    })
}

/// What decided the comparison: the stages that ran at another speed (memory), the pools'
/// balance and the handoff.
pub(crate) fn print_decided(d: &Summary, c: &Summary) {
    let thr = |s: &Summary| s.requests as f64 / s.elapsed.as_secs_f64().max(1e-9);
    let r = thr(d) / thr(c).max(1e-12);
    println!();
    println!("what decided it:");
    if d.differences.is_empty() {
        println!("- stage times: every stage runs at the same speed colocated and in its own pool");
    }
    for line in &d.differences {
        println!("- stage time: {line}");
    }
    let idle = d.utilisation.inspect(|u| {
        println!(
            "- pool balance: the pools were busy {:.0}% / {:.0}% / {:.0}% (encode / denoise / decode) of their time",
            u[0] * 100.0,
            u[1] * 100.0,
            u[2] * 100.0
        );
    });
    println!("- handoff: {:.1} MiB between pools, none colocated", d.moved as f64 / 1048576.0);
    let verdict = match (r >= 1.0, d.differences.is_empty()) {
        (true, false) => "stage times: stages ran faster in their own pools (memory not shared with the other stages, or a class that suits them), more than the pools' idle time cost".to_string(),
        (true, true) => "overlap: no stage ran faster, but the pipeline kept the busiest pool fed".to_string(),
        (false, true) => format!(
            "pool balance: no stage ran faster in its own pool, and the pools idled{}",
            idle.map_or(String::new(), |u| format!(" (least busy {:.0}%)", u.iter().fold(1.0f64, |a, &b| a.min(b)) * 100.0))
        ),
        (false, false) => "pool balance: stages ran faster in their own pools, but the pools' idle time cost more".to_string(),
    };
    println!("disaggregated throughput {r:.2}x colocated, decided by {verdict}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&[], 99.0), Duration::ZERO);
    }
}
