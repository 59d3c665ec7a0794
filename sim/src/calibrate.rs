//! `simulate --calibrate`: the simulator against published disaggregated-vs-colocated results
//! (`profiles/published.toml`, each with its citation). Both layouts of a result run saturated
//! with its model and class; the simulated throughput ratio must come within the result's
//! tolerance of the published one, or the result names the mechanism the simulator lacks.

use std::path::Path;

use serde::Deserialize;

use super::classes::GpuClass;
use super::engine::{self, Knobs, Load, Prepared};
use super::layout::Layout;
use super::workload::Mix;
use crate::Result;
use crate::profiles::{self, Model};

/// The results shipped with the binary.
const SHIPPED: &str = include_str!("../profiles/published.toml");

/// One published result.
#[derive(Debug, Clone, Deserialize)]
pub struct Published {
    /// What was measured, with the figures.
    pub what: String,
    /// Model (a profile name).
    pub model: String,
    /// GPU class of every pool.
    pub class: String,
    /// The colocated layout.
    pub colocated: String,
    /// The disaggregated layout.
    pub disaggregated: String,
    /// Published throughput ratio, disaggregated over colocated.
    pub ratio: f64,
    /// Relative tolerance.
    pub tolerance: f64,
    /// The mechanism the simulator lacks, when it misses.
    #[serde(default)]
    pub lacks: Option<String>,
}

#[derive(Debug, Deserialize)]
struct File {
    result: Vec<Published>,
}

/// Results from `path`, or the shipped ones.
pub fn load(path: Option<&Path>) -> Result<Vec<Published>> {
    let (text, origin) = match path {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|e| format!("{}: cannot read: {e}", p.display()))?,
            p.display().to_string(),
        ),
        None => (SHIPPED.to_string(), "built-in published.toml".to_string()),
    };
    let f: File = toml::from_str(&text)
        .map_err(|e| format!("{origin}: not a valid results file: {}", e.message()))?;
    Ok(f.result)
}

/// One result checked.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The result.
    pub published: Published,
    /// Simulated capacities, colocated and disaggregated (requests per second).
    pub throughput: (f64, f64),
    /// The same with every time derived (the model's measured times ignored): how far the
    /// derivations alone (class speed, offload over the host link) get.
    pub derived: (f64, f64),
}

impl Checked {
    /// Simulated ratio.
    pub fn ratio(&self) -> f64 {
        self.throughput.1 / self.throughput.0.max(1e-12)
    }

    /// Simulated ratio with derived times only.
    pub fn derived_ratio(&self) -> f64 {
        self.derived.1 / self.derived.0.max(1e-12)
    }

    /// Within the tolerance.
    pub fn within(&self) -> bool {
        (self.ratio() / self.published.ratio - 1.0).abs() <= self.published.tolerance
    }
}

/// Requests per run (the published load tests ran 100).
const REQUESTS: u64 = 100;

/// Runs every result.
pub fn check(
    results: &[Published],
    models: &[Model],
    classes: &[GpuClass],
    knobs: &Knobs,
) -> Result<Vec<Checked>> {
    let mut out = Vec::new();
    for r in results {
        let m = profiles::pick(models, std::slice::from_ref(&r.model))?[0].clone();
        let derived = Model { measured: Vec::new(), ..m.clone() };
        let throughput = pair(r, m, classes, knobs)?;
        let derived = pair(r, derived, classes, knobs)?;
        out.push(Checked { published: r.clone(), throughput, derived });
    }
    Ok(out)
}

/// Capacities of a result's colocated and disaggregated layouts serving `m`.
fn pair(r: &Published, m: Model, classes: &[GpuClass], knobs: &Knobs) -> Result<(f64, f64)> {
    let mix = Mix::single(m);
    let mut thr = [0.0; 2];
    for (i, l) in [&r.colocated, &r.disaggregated].into_iter().enumerate() {
        let layout = Layout::parse(l, &r.class)?;
        let p = Prepared::new(&layout, classes, &mix, knobs.cfg)
            .map_err(|e| format!("{}: {l}: {e}", r.what))?;
        thr[i] =
            engine::simulate(&p, &mix, knobs, Load::Saturated { requests: REQUESTS })?.throughput;
    }
    Ok((thr[0], thr[1]))
}
