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
        }
        .rounded()
    }

    /// Prints the line: JSON on stdout, a readable form on stderr.
    pub fn emit(&self) {
        eprintln!(
            "{:>8} {:>7}: tensorwire {:>7.3} GB/s   {} {:>7.3} GB/s   ratio {:.3}",
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
}
