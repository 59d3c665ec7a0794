//! The demo's scenarios: a cluster (a GPU class for colocated serving and for each
//! disaggregated pool) and a request mix. The stage times the demo's workers sleep come from the
//! capacity model's fit of each layout ([`tensorwire_sim::fit`]): colocated serving pays what
//! sharing one GPU's memory costs (offloaded weights, tiled decode), each pool what its own
//! class costs. The scenario then names what decided the comparison.

use tensorwire_orchestrator::Stage;
use tensorwire_sim::classes::{self, GpuClass};
use tensorwire_sim::fit::{self, Mode, StageCost};
use tensorwire_sim::layout::{Pool, stages};
use tensorwire_sim::profiles::Model;

/// One scenario.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scenario {
    /// Name for `--scenario`.
    pub(crate) name: &'static str,
    /// Why it is interesting, from the data.
    pub(crate) about: &'static str,
    /// The request mix (profile names), round robin.
    pub(crate) models: &'static [&'static str],
    /// GPU class of colocated serving.
    pub(crate) colocated: &'static str,
    /// GPU class of the encode, denoise and decode pools.
    pub(crate) pools: [&'static str; 3],
}

/// Every scenario; the first is the default.
pub(crate) const SCENARIOS: [Scenario; 3] = [
    Scenario {
        name: "memory-bound",
        about: "Qwen-Image-2512 (8-step DiT) on RTX 4090s: its 58 GB of weights do not fit a 24 GB GPU, so colocated serving offloads; LightX2V measured the text encoder at 12.9 s offloaded vs 0.4 s alone and the DiT at 2.90 vs 1.88 s per step (profiles: measured)",
        models: &["qwen-image-2512-8step"],
        colocated: "rtx4090",
        pools: ["rtx4090", "rtx4090", "rtx4090"],
    },
    Scenario {
        name: "fits",
        about: "Wan2.1-1.3B video, FLUX.1-dev and Qwen-Image on H200s: the three pipelines (104 GB of weights) fit one 141 GB GPU, so no stage runs faster in a pool of its own, and pools sized to the mix's stage times idle in part",
        models: &["wan2.1-t2v-1.3b-480p", "flux.1-dev-1024", "qwen-image-1328"],
        colocated: "h200",
        pools: ["h200", "h200", "h200"],
    },
    Scenario {
        name: "heterogeneous",
        about: "Qwen-Image (1328px) on A100 40GB vs encoders and VAEs on L40S and DiTs on H100: colocated on 40 GB the 58 GB pipeline offloads, and the split puts each stage on the class that suits it",
        models: &["qwen-image-1328"],
        colocated: "a100-40gb",
        pools: ["l40s", "h100", "l40s"],
    },
];

/// The scenario that compares elastic pools with fixed ones (see `crate::demo::shift`), not a
/// layout comparison.
pub(crate) const SHIFT: &str = "shift";

/// A scenario by name; the error lists them.
pub(crate) fn pick(name: &str) -> anyhow::Result<Scenario> {
    SCENARIOS.iter().copied().find(|s| s.name == name).ok_or_else(|| {
        let known: Vec<&str> = SCENARIOS.iter().map(|s| s.name).chain([SHIFT]).collect();
        anyhow::anyhow!("unknown scenario {name:?}; known: {}", known.join(", "))
    })
}

/// The models with the stage times of each layout, and what differed.
#[derive(Debug, Clone)]
pub(crate) struct Timed {
    /// Stage times on colocated GPUs.
    pub(crate) colocated: Vec<Model>,
    /// Stage times in the pools.
    pub(crate) disaggregated: Vec<Model>,
    /// Stages that run at another speed colocated than in their pool, one line each.
    pub(crate) differences: Vec<String>,
    /// US$ per hour of one GPU: colocated, and of each pool's class.
    pub(crate) usd: (f64, [f64; 3]),
}

/// `models` with their times set from `costs` (per model, per stage).
fn with_costs(models: &[Model], costs: &[[Option<StageCost>; 3]]) -> Vec<Model> {
    models
        .iter()
        .zip(costs)
        .map(|(m, c)| {
            let t = |s: Stage, x: f64| c[s.index()].map_or(x, |c| c.ms);
            Model {
                encode_ms: t(Stage::Encode, m.encode_ms),
                step_ms: t(Stage::Denoise, m.step_ms),
                decode_ms: t(Stage::Decode, m.decode_ms),
                ..m.clone()
            }
        })
        .collect()
}

fn how(c: Option<StageCost>) -> &'static str {
    match c.map(|c| c.mode) {
        Some(Mode::Offload(_)) => "offloaded",
        Some(Mode::Tiled) => "tiled",
        Some(Mode::Measured) => "measured",
        _ => "resident",
    }
}

/// Times each stage of `models` in the scenario's layouts.
pub(crate) fn time(s: &Scenario, models: &[Model]) -> anyhow::Result<Timed> {
    let all: Vec<GpuClass> = classes::load(None)?;
    let refs: Vec<&Model> = models.iter().collect();
    let class = |n: &str| classes::pick(&all, n);
    let pool = |letters: &str, c: &str| Pool { stages: stages(letters), class: c.into(), count: 1 };
    let colo = fit::fit(&pool("EDV", s.colocated), class(s.colocated)?, &refs, true)
        .map_err(|e| anyhow::anyhow!("scenario {}: colocated on {}: {e}", s.name, s.colocated))?;
    let mut apart = vec![[None; 3]; models.len()];
    for (i, letters) in ["E", "D", "V"].into_iter().enumerate() {
        let f =
            fit::fit(&pool(letters, s.pools[i]), class(s.pools[i])?, &refs, true).map_err(|e| {
                anyhow::anyhow!("scenario {}: {letters} pool on {}: {e}", s.name, s.pools[i])
            })?;
        for (row, c) in apart.iter_mut().zip(f.costs) {
            row[i] = c[i];
        }
    }
    let mut differences = Vec::new();
    for (m, (c, d)) in models.iter().zip(colo.costs.iter().zip(&apart)) {
        for st in Stage::ALL {
            let (Some(x), Some(y)) = (c[st.index()], d[st.index()]) else { continue };
            if (x.ms / y.ms - 1.0).abs() > 0.05 {
                let per = if st == Stage::Denoise { " per step" } else { "" };
                differences.push(format!(
                    "{} {}: {:.0} ms{per} colocated on {} ({}) vs {:.0} ms in its pool on {} ({})",
                    m.name,
                    st.name(),
                    x.ms,
                    s.colocated,
                    how(Some(x)),
                    y.ms,
                    s.pools[st.index()],
                    how(Some(y))
                ));
            }
        }
    }
    let price = |n: &str| class(n).map(|c| c.usd_per_hour);
    Ok(Timed {
        colocated: with_costs(models, &colo.costs),
        disaggregated: with_costs(models, &apart),
        differences,
        usd: (price(s.colocated)?, [price(s.pools[0])?, price(s.pools[1])?, price(s.pools[2])?]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_sim::profiles;

    #[test]
    fn every_scenario_fits_and_the_memory_bound_one_differs() {
        let all = profiles::load(None).unwrap();
        for s in SCENARIOS {
            let names: Vec<String> = s.models.iter().map(|m| m.to_string()).collect();
            let models: Vec<Model> =
                profiles::pick(&all, &names).unwrap().into_iter().cloned().collect();
            let t = time(&s, &models).unwrap();
            assert_eq!(t.colocated.len(), models.len());
            if s.name == "memory-bound" {
                assert_eq!(t.colocated[0].encode_ms, 12890.0);
                assert_eq!(t.disaggregated[0].step_ms, 1880.0);
                assert!(t.differences.iter().any(|d| d.contains("encode: 12890 ms")), "{t:?}");
            }
            if s.name == "fits" {
                assert!(t.differences.is_empty(), "{:?}", t.differences);
            }
        }
        assert!(pick("nope").unwrap_err().to_string().contains("known: memory-bound"));
    }
}
