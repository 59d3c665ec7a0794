//! Timing loops and statistics.

use crate::Result;
use std::future::Future;
use std::time::{Duration, Instant};

/// How long one measurement runs.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Iterate at least this long (after one untimed warm-up iteration).
    pub min_time: Duration,
    /// Never more than this many timed iterations.
    pub max_iters: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Budget { min_time: Duration::from_millis(200), max_iters: 100_000 }
    }
}

/// Runs `iter` (which moves `bytes` per call) for the budget; returns GB/s (10^9 bytes/s).
pub async fn gbps<F, Fut>(budget: Budget, bytes: u64, mut iter: F) -> Result<f64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    iter().await?; // warm-up: faults pages in, opens lazy connections
    let start = Instant::now();
    let mut n = 0u64;
    while n < budget.max_iters.max(1) && (n == 0 || start.elapsed() < budget.min_time) {
        iter().await?;
        n += 1;
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    Ok((bytes * n) as f64 / secs / 1e9)
}

/// Runs `runs` interleaved samples of `a` (tensorwire) and `b` (the baseline), each moving `bytes`
/// per call, alternating which goes first; returns both sample lists in GB/s.
pub async fn interleaved<A, FA, B, FB>(
    runs: usize,
    budget: Budget,
    bytes: u64,
    mut a: A,
    mut b: B,
) -> Result<(Vec<f64>, Vec<f64>)>
where
    A: FnMut() -> FA,
    FA: Future<Output = Result<()>>,
    B: FnMut() -> FB,
    FB: Future<Output = Result<()>>,
{
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for run in 0..runs.max(1) {
        // Alternate which goes first, so neither always gets the warmer caches.
        if run % 2 == 0 {
            ys.push(gbps(budget, bytes, &mut b).await?);
            xs.push(gbps(budget, bytes, &mut a).await?);
        } else {
            xs.push(gbps(budget, bytes, &mut a).await?);
            ys.push(gbps(budget, bytes, &mut b).await?);
        }
    }
    Ok((xs, ys))
}

/// Median of `v` (mean of the middle two for even lengths); 0 for an empty slice.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 { s[m] } else { (s[m - 1] + s[m]) / 2.0 }
}

/// Parses sizes like `4096`, `4K`, `64KiB`, `16M`, `1G` (binary units).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Formats a byte count with a binary unit.
pub fn fmt_size(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => format!("{n}B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_medians() {
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("64MiB"), Some(64 << 20));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_size("1T"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(fmt_size(256 << 20), "256MiB");
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[tokio::test]
    async fn gbps_counts_bytes_over_time() {
        let budget = Budget { min_time: Duration::from_millis(20), max_iters: 1000 };
        let r = gbps(budget, 1000, || async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok(())
        })
        .await
        .unwrap();
        // 1000 bytes per >= 1 ms iteration: at most 1 MB/s.
        assert!(r > 0.0 && r <= 0.001, "{r}");
    }
}
