//! The JSON lines the harness prints: one per measurement, then one summary.

use serde::Serialize;

/// One measurement: tensorwire against the raw medium, medians over interleaved runs.
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    /// Backend (or mode) measured.
    pub backend: String,
    /// "read" or "write".
    pub op: String,
    /// Bytes per op.
    pub size: u64,
    /// Streams (connections) used by both sides.
    pub streams: usize,
    /// Median tensorwire GB/s (10^9 bytes/s).
    pub gbps: f64,
    /// What the baseline is.
    pub baseline: String,
    /// Median baseline GB/s.
    pub baseline_gbps: f64,
    /// The median over runs of each run's tensorwire GB/s over its baseline GB/s (both sides of a
    /// run share its stretch of the machine: see `measure::interleaved`).
    pub ratio: f64,
    /// Interleaved runs behind the medians.
    pub runs: usize,
    /// Every run's tensorwire GB/s.
    pub samples: Vec<f64>,
    /// Every run's baseline GB/s.
    pub baseline_samples: Vec<f64>,
    /// The medium's physical bound at this size, when the harness measured one ([`Line::bounded`]):
    /// "memcpy/2" for tcp (the kernel copies every byte twice, into the socket and out of it),
    /// "memcpy" for a one-copy medium (shm, mem, UCX's shared memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound: Option<String>,
    /// The bound's GB/s: memcpy of the same size, measured in the same run right after the
    /// samples, divided by the medium's copies per byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound_gbps: Option<f64>,
    /// tensorwire's median GB/s over the bound's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound_ratio: Option<f64>,
    /// Ops per submit, for a batch measurement ([`Line::batched`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<usize>,
    /// tensorwire's median ops per second (a batch measurement).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops_per_s: Option<f64>,
    /// The baseline's median ops per second (a batch measurement).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_ops_per_s: Option<f64>,
}

/// The final line.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Always true (tells it apart from measurement lines).
    pub summary: bool,
    /// Backend measured.
    pub backend: String,
    /// Measurement lines printed.
    pub measurements: usize,
    /// Lowest ratio.
    pub min_ratio: f64,
    /// Median ratio.
    pub median_ratio: f64,
    /// Lines with the lowest ratio, as "op@size".
    pub worst: String,
    /// CPU cores of this machine.
    pub cores: usize,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl Line {
    /// A line from the samples of one interleaved measurement.
    pub fn from_samples(
        backend: &str,
        op: &str,
        size: u64,
        streams: usize,
        baseline: &str,
        samples: Vec<f64>,
        baseline_samples: Vec<f64>,
    ) -> Line {
        let (g, b) = (crate::measure::median(&samples), crate::measure::median(&baseline_samples));
        let ratios: Vec<f64> = samples
            .iter()
            .zip(&baseline_samples)
            .filter(|(_, b)| **b > 0.0)
            .map(|(g, b)| g / b)
            .collect();
        Line {
            backend: backend.into(),
            op: op.into(),
            size,
            streams,
            gbps: g,
            baseline: baseline.into(),
            baseline_gbps: b,
            ratio: crate::measure::median(&ratios),
            runs: samples.len(),
            samples,
            baseline_samples,
            bound: None,
            bound_gbps: None,
            bound_ratio: None,
            batch: None,
            ops_per_s: None,
            baseline_ops_per_s: None,
        }
        .rounded()
    }

    /// The line of a batch of `n` ops per submit, with both sides' ops per second.
    pub fn batched(mut self, n: usize) -> Line {
        let per_s = |gbps: f64| (gbps * 1e9 / self.size.max(1) as f64).round();
        self.batch = Some(n);
        self.ops_per_s = Some(per_s(self.gbps));
        self.baseline_ops_per_s = Some(per_s(self.baseline_gbps));
        self
    }

    /// The line with the medium's bound: `copies` copies of every byte at `memcpy_gbps`.
    pub fn bounded(mut self, copies: u32, memcpy_gbps: f64) -> Line {
        let what = if copies == 1 { "memcpy".to_string() } else { format!("memcpy/{copies}") };
        let b = memcpy_gbps / f64::from(copies.max(1));
        self.bound = Some(what);
        self.bound_gbps = Some(round3(b));
        self.bound_ratio = (b > 0.0).then(|| round3(self.gbps / b));
        self
    }

    /// Prints the line: JSON on stdout, a readable form on stderr.
    pub fn emit(&self) {
        let bound = match (&self.bound, self.bound_gbps, self.bound_ratio) {
            (Some(w), Some(g), Some(r)) => format!("   bound {w} {g:>7.3} GB/s   ratio {r:.3}"),
            _ => String::new(),
        };
        eprintln!(
            "{:>8} {:>7}: tensorwire {:>7.3} GB/s   {} {:>7.3} GB/s   ratio {:.3}{bound}",
            self.op,
            crate::measure::fmt_size(self.size),
            self.gbps,
            self.baseline,
            self.baseline_gbps,
            self.ratio
        );
        println!("{}", serde_json::to_string(self).unwrap_or_default());
    }

    /// Rounds the floats for printing.
    pub fn rounded(mut self) -> Self {
        self.gbps = round3(self.gbps);
        self.baseline_gbps = round3(self.baseline_gbps);
        self.ratio = round3(self.ratio);
        self.samples = self.samples.iter().copied().map(round3).collect();
        self.baseline_samples = self.baseline_samples.iter().copied().map(round3).collect();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_pairs_each_run_with_its_own_baseline() {
        // Runs' ratios 2, 1 and 3: their median is 2 (the medians' ratio would be 4 / 3).
        let l = Line::from_samples(
            "tcp",
            "read",
            4096,
            2,
            "x",
            vec![2.0, 4.0, 9.0],
            vec![1.0, 4.0, 3.0],
        );
        assert_eq!((l.gbps, l.baseline_gbps, l.ratio), (4.0, 3.0, 2.0));
        let none = Line::from_samples("tcp", "read", 4096, 2, "x", vec![1.0], vec![0.0]);
        assert_eq!(none.ratio, 0.0, "a baseline that moved nothing gives no ratio");
    }

    #[test]
    fn the_bound_divides_memcpy_by_the_copies_per_byte() {
        let l =
            Line::from_samples("tcp", "read", 4096, 2, "x", vec![3.0], vec![1.0]).bounded(2, 12.0);
        assert_eq!(l.bound.as_deref(), Some("memcpy/2"));
        assert_eq!((l.bound_gbps, l.bound_ratio), (Some(6.0), Some(0.5)));
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.contains("\"bound_ratio\":0.5"), "{json}");
        let plain = Line::from_samples("tcp", "read", 4096, 2, "x", vec![3.0], vec![1.0]);
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("bound"), "no bound measured, none printed: {json}");
        let shm = Line::from_samples("shm", "write", 4096, 1, "memcpy", vec![3.0], vec![4.0]);
        assert_eq!(shm.bounded(1, 4.0).bound.as_deref(), Some("memcpy"));
    }
}
