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
    let mut t = Tally::default();
    t.turn(budget.min_time, budget.max_iters, &mut iter).await?;
    Ok(t.gbps(bytes))
}

/// Turns each side takes within one run of [`interleaved`]: each turn lasts
/// `budget.min_time / TURNS` (and at least one op).
pub const TURNS: u32 = 10;

/// Runs `runs` interleaved runs of `a` (tensorwire) and `b` (the baseline), each moving `bytes`
/// per call; returns each run's GB/s of both sides.
///
/// Within a run the two take turns of `budget.min_time / TURNS` (at least one op each), the one
/// that goes first alternating from turn to turn, until each has run for `budget.min_time`; a
/// side's sample is its bytes over its time in that run. So both sides of a run see the same
/// stretch of a shared machine, and a run's ratio is not swayed by the machine being busier
/// while one side had the whole of a 200 ms sample than while the other had its own (on the
/// shared 2-core machine, 5-run medians of whole back-to-back samples swung by up to 0.36
/// between sweeps). Each side makes one untimed op first in every run (faults pages in, opens lazy
/// connections, wakes the peer's threads).
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
    let turn = budget.min_time / TURNS;
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for run in 0..runs.max(1) {
        a().await?;
        b().await?;
        let (mut ta, mut tb) = (Tally::default(), Tally::default());
        let mut k = run;
        while ta.time < budget.min_time || tb.time < budget.min_time {
            // Alternate which goes first, so neither always gets the warmer caches.
            if k % 2 == 0 {
                tb.turn(turn, budget.max_iters, &mut b).await?;
                ta.turn(turn, budget.max_iters, &mut a).await?;
            } else {
                ta.turn(turn, budget.max_iters, &mut a).await?;
                tb.turn(turn, budget.max_iters, &mut b).await?;
            }
            k += 1;
        }
        xs.push(ta.gbps(bytes));
        ys.push(tb.gbps(bytes));
    }
    Ok((xs, ys))
}

/// What one side of an [`interleaved`] run has done so far.
#[derive(Debug, Default)]
struct Tally {
    ops: u64,
    time: Duration,
}

impl Tally {
    /// Runs ops for one turn of about `turn` (at least one op, at most `max_ops` in the run).
    async fn turn<F, Fut>(&mut self, turn: Duration, max_ops: u64, iter: &mut F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<()>>,
    {
        let start = Instant::now();
        let mut n = 0u64;
        while n == 0 || (start.elapsed() < turn && self.ops + n < max_ops.max(1)) {
            iter().await?;
            n += 1;
        }
        self.ops += n;
        self.time += start.elapsed();
        Ok(())
    }

    fn gbps(&self, bytes: u64) -> f64 {
        (bytes * self.ops) as f64 / self.time.as_secs_f64().max(1e-9) / 1e9
    }
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

    /// Both sides of a run take turns, and each side's sample is its own bytes over its own time.
    #[tokio::test]
    async fn interleaved_runs_take_turns_and_time_each_side_apart() {
        use std::sync::{Arc, Mutex};
        let order = Arc::new(Mutex::new(Vec::new()));
        let budget = Budget { min_time: Duration::from_millis(40), max_iters: 1000 };
        let side = |name: char, ms: u64| {
            let order = order.clone();
            move || {
                let order = order.clone();
                async move {
                    order.lock().unwrap().push(name);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(())
                }
            }
        };
        let (xs, ys) = interleaved(3, budget, 1000, side('a', 1), side('b', 5)).await.unwrap();
        assert_eq!((xs.len(), ys.len()), (3, 3));
        for (x, y) in xs.iter().zip(&ys) {
            // a's ops take a fifth of b's time: a faster rate, whatever the turns.
            assert!(x > y, "a {x} b {y}");
            assert!(
                *x <= 0.001 && *y <= 0.001 / 5.0,
                "at most 1000 bytes per ms (a), per 5 ms (b)"
            );
        }
        // The sides take turns within each run (each side needs two turns of at least 4 ms to
        // reach 40 ms, however slow its ops), not one block each.
        let o = order.lock().unwrap();
        let switches = o.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(switches >= 3 * 4, "{switches} switches in {} ops", o.len());
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
