//! `simulate --plan`: searches layouts within a budget. Every grouping of the stages, every
//! class for each pool and every split of the budget is scored with the analytic bound (each
//! pool's GPUs over its work per request); the best candidates are then simulated with the
//! orchestrator's scheduler, saturated for capacity and under the offered load for TTFF.

use tensorwire_orchestrator::Stage;

use super::classes::GpuClass;
use super::engine::Prepared;
use super::fit;
use super::layout::{GROUPINGS, Layout, Pool, stages};
use super::workload::Mix;

/// What the search may spend.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// GPUs, all used (None: as many as the dollars buy).
    pub gpus: Option<u32>,
    /// US$ per hour (None: no limit).
    pub usd_per_hour: Option<f64>,
}

/// A pool may hold at most this many GPUs unless it serves denoise (which takes the rest).
const SMALL_POOL_MAX: u32 = 8;
/// At most this many GPUs in one layout.
const MAX_GPUS: u32 = 4096;

/// A candidate with its analytic capacity (requests per second).
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The layout (fitted).
    pub prepared: Prepared,
    /// Analytic capacity.
    pub bound: f64,
}

/// Work per request on one GPU of `pool` (seconds), from its fit: its stages' times weighted by
/// the mix, with encode skipped for cache hits.
fn work_s(pool: &Pool, fit: &fit::PoolFit, mix: &Mix, hit_rate: f64) -> f64 {
    let mut total = 0.0;
    for (e, costs) in mix.entries.iter().zip(&fit.costs) {
        let mut w = 0.0;
        for s in Stage::ALL.into_iter().filter(|s| pool.stages[s.index()]) {
            let Some(c) = costs[s.index()] else { continue };
            w += match s {
                Stage::Encode => c.ms * (1.0 - hit_rate),
                Stage::Denoise => c.ms * f64::from(e.model.steps.max(1)),
                Stage::Decode => c.ms,
            };
        }
        total += e.share * w / 1e3;
    }
    total
}

/// The analytic capacity of each pool of a fitted layout (requests per second).
pub fn pool_bounds(p: &Prepared, mix: &Mix, hit_rate: f64) -> Vec<f64> {
    p.layout
        .pools
        .iter()
        .zip(&p.fits)
        .map(|(pool, f)| f64::from(pool.count) / work_s(pool, f, mix, hit_rate).max(1e-12))
        .collect()
}

/// The analytic capacity of a fitted layout and its bottleneck pool.
pub fn bound(p: &Prepared, mix: &Mix, hit_rate: f64) -> (f64, usize) {
    pool_bounds(p, mix, hit_rate)
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c, i))
        .fold((f64::INFINITY, 0), |a, b| if b.0 < a.0 { b } else { a })
}

/// Every layout within `budget` over `classes` that fits, best analytic capacity first (per
/// dollar when the budget is in dollars); `infeasible` collects one reason per grouping and class
/// that never fits.
pub fn search(
    classes: &[GpuClass],
    mix: &Mix,
    budget: Budget,
    cfg: bool,
    hit_rate: f64,
    infeasible: &mut Vec<String>,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for grouping in GROUPINGS {
        let n = grouping.len();
        // Every class for every pool.
        let mut picks = vec![0usize; n];
        loop {
            let pools: Vec<Pool> = grouping
                .iter()
                .zip(&picks)
                .map(|(letters, &c)| Pool {
                    stages: stages(letters),
                    class: classes[c].name.clone(),
                    count: 1,
                })
                .collect();
            let fitted = Prepared::new(&Layout { pools: pools.clone() }, classes, mix, cfg);
            match fitted {
                Err(e) => {
                    if !infeasible.contains(&e.0) {
                        infeasible.push(e.0);
                    }
                }
                Ok(one) => expand(&one, classes, mix, budget, hit_rate, &mut out),
            }
            // Next class assignment.
            let mut i = 0;
            while i < n {
                picks[i] += 1;
                if picks[i] < classes.len() {
                    break;
                }
                picks[i] = 0;
                i += 1;
            }
            if i == n {
                break;
            }
        }
    }
    let per_dollar = budget.usd_per_hour.is_some() && budget.gpus.is_none();
    let score = |c: &Candidate| {
        if per_dollar { c.bound / c.prepared.usd_per_hour.max(1e-12) } else { c.bound }
    };
    out.sort_by(|a, b| score(b).total_cmp(&score(a)));
    out
}

/// Every split of the budget over `one`'s pools (counts of 1 each): the pools without denoise
/// get 1..=SMALL_POOL_MAX GPUs, the denoise pool the rest of the budget.
fn expand(
    one: &Prepared,
    classes: &[GpuClass],
    mix: &Mix,
    budget: Budget,
    hit_rate: f64,
    out: &mut Vec<Candidate>,
) {
    let pools = &one.layout.pools;
    let price =
        |p: &Pool| classes.iter().find(|c| c.name == p.class).map_or(0.0, |c| c.usd_per_hour);
    let main = pools.iter().position(|p| p.stages[Stage::Denoise.index()]).unwrap_or(0);
    let small: Vec<usize> = (0..pools.len()).filter(|&i| i != main).collect();
    let mut counts = vec![1u32; pools.len()];
    loop {
        let used_gpus: u32 = small.iter().map(|&i| counts[i]).sum();
        let used_usd: f64 = small.iter().map(|&i| price(&pools[i]) * f64::from(counts[i])).sum();
        let main_n = match (budget.gpus, budget.usd_per_hour) {
            (Some(g), usd) => {
                let n = g.saturating_sub(used_gpus);
                let total = used_usd + price(&pools[main]) * f64::from(n);
                (n >= 1 && usd.is_none_or(|u| total <= u + 1e-9)).then_some(n)
            }
            (None, Some(u)) => {
                let n = ((u - used_usd) / price(&pools[main]).max(1e-12) + 1e-9).floor();
                (n >= 1.0).then_some((n as u32).min(MAX_GPUS))
            }
            (None, None) => None,
        };
        if let Some(m) = main_n {
            counts[main] = m;
            let mut p = one.clone();
            for (pool, &c) in p.layout.pools.iter_mut().zip(&counts) {
                pool.count = c;
            }
            p.usd_per_hour = p.layout.pools.iter().map(|q| price(q) * f64::from(q.count)).sum();
            let (b, _) = bound(&p, mix, hit_rate);
            out.push(Candidate { prepared: p, bound: b });
        }
        // Next split of the small pools.
        let mut i = 0;
        while i < small.len() {
            counts[small[i]] += 1;
            if counts[small[i]] <= SMALL_POOL_MAX {
                break;
            }
            counts[small[i]] = 1;
            i += 1;
        }
        if i == small.len() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classes;
    use crate::profiles;

    #[test]
    fn the_search_covers_every_grouping_and_keeps_the_budget() {
        let all = profiles::load(None).unwrap();
        let mix = Mix::parse("wan2.1-t2v-14b-480p", &all).unwrap();
        let cls: Vec<GpuClass> = classes::load(None)
            .unwrap()
            .into_iter()
            .filter(|c| ["h100", "l40s", "rtx4090"].contains(&c.name.as_str()))
            .collect();
        let mut why = Vec::new();
        let b = Budget { gpus: Some(8), usd_per_hour: None };
        let found = search(&cls, &mix, b, true, 0.0, &mut why);
        for g in GROUPINGS {
            let kind = g.join("|");
            assert!(found.iter().any(|c| c.prepared.layout.kind() == kind), "{kind}");
        }
        assert!(found.iter().all(|c| c.prepared.layout.gpus() == 8));
        assert!(found.windows(2).all(|w| w[0].bound >= w[1].bound));
        // A Wan 14B DiT (28 GB + 8 GB of activations) streams weights on a 4090 at every step:
        // by requests per second the best layouts denoise on H100s.
        let best = &found[0].prepared.layout;
        assert!(best.pools.iter().any(|p| p.stages[1] && p.class == "h100"), "{best}");
        let usd = Budget { gpus: None, usd_per_hour: Some(20.0) };
        let cheap = search(&cls, &mix, usd, true, 0.0, &mut why);
        assert!(cheap.iter().all(|c| c.prepared.usd_per_hour <= 20.0 + 1e-9));
    }
}
