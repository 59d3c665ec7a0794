//! Does a pool's work fit its GPU, and what does each stage cost there? A pool's GPU holds the
//! weights of every stage it serves for every model of the workload, plus the largest peak of
//! activations. What does not fit is streamed over the host link at each forward (CPU offload:
//! the DiT's weights at every step, the encoder's and the VAE's once per request); a VAE whose
//! activations do not fit decodes in tiles; activations that fit in no way make the pool
//! infeasible, and the reason says which.

use tensorwire_orchestrator::Stage;

use super::classes::GpuClass;
use super::layout::Pool;
use crate::Result;
use crate::profiles::Model;

/// Tiled VAE decode: peak activations divided by this (est: 4 spatial tiles).
const TILE_ACT_DIVISOR: f64 = 4.0;
/// Tiled VAE decode: time multiplied by this (est: overlap recomputed at tile seams).
const TILE_TIME: f64 = 1.25;
/// Offloaded weights loaded once per request (the encoder's, the VAE's) arrive at this share of
/// the host link's bandwidth, on the critical path. est from LightX2V's RTX 4090 baseline
/// (DisaggBlogPost): Qwen2.5-VL (16.6 GB) took 12.49 s longer offloaded (0.05 of 25 GB/s), Wan's
/// T5 (9.4 GB) 1.94 s longer (0.19); 0.1 is about their geometric mean.
const ONCE_OFFLOAD_EFFICIENCY: f64 = 0.1;
/// A DiT step without CFG: this share of the time with it (est: one branch instead of a batch
/// of two, on compute-bound kernels).
const NO_CFG_STEP: f64 = 0.5;

/// How a stage runs on a pool's GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Everything resident.
    Resident,
    /// GB of weights streamed over the host link per forward.
    Offload(f64),
    /// The VAE decodes in tiles (its activations did not fit).
    Tiled,
    /// A time measured on this class (whatever the source's setup did).
    Measured,
}

/// One stage of one model on a pool's GPU.
#[derive(Debug, Clone, Copy)]
pub struct StageCost {
    /// Milliseconds per request (per step for denoise).
    pub ms: f64,
    /// How it runs.
    pub mode: Mode,
}

/// What each model's stages cost on a pool: `costs[model][stage]` (None: the pool does not
/// serve the stage), and lines on what the fit decided.
#[derive(Debug, Clone)]
pub struct PoolFit {
    /// Per model, per stage.
    pub costs: Vec<[Option<StageCost>; 3]>,
    /// What decided the costs (offload, tiling, measured figures, figures missing).
    pub notes: Vec<String>,
}

/// Fits `pool` on `class` for `models`; `cfg`: classifier-free guidance on for models that use
/// it. Err: why it cannot run at all.
pub fn fit(pool: &Pool, class: &GpuClass, models: &[&Model], cfg: bool) -> Result<PoolFit> {
    let served: Vec<Stage> = Stage::ALL.into_iter().filter(|s| pool.stages[s.index()]).collect();
    let mut notes = Vec::new();
    let weights = |m: &Model, s: Stage| m.weights_gb.map_or(0.0, |w| w.get(s));
    let mut act: Vec<[f64; 3]> = models
        .iter()
        .map(|m| std::array::from_fn(|i| m.act_gb.map_or(0.0, |a| a.get(Stage::ALL[i]))))
        .collect();
    for m in models.iter().filter(|m| m.weights_gb.is_none()) {
        notes.push(format!("{}: no memory figures, assumed to fit", m.name));
    }
    let total_w: f64 = models.iter().flat_map(|m| served.iter().map(|&s| weights(m, s))).sum();
    let peak = |act: &[[f64; 3]]| -> f64 {
        act.iter().flat_map(|a| served.iter().map(|s| a[s.index()])).fold(0.0, f64::max)
    };
    // A VAE whose activations are what does not fit decodes in tiles.
    let mut tiled = false;
    if pool.stages[Stage::Decode.index()] && total_w + peak(&act) > class.vram_gb {
        let rest = act
            .iter()
            .flat_map(|a| served.iter().filter(|s| **s != Stage::Decode).map(move |s| a[s.index()]))
            .fold(0.0, f64::max);
        if act.iter().any(|a| a[Stage::Decode.index()] > rest) {
            for a in &mut act {
                a[Stage::Decode.index()] /= TILE_ACT_DIVISOR;
            }
            tiled = true;
            notes.push("tiled VAE decode (its activations do not fit)".to_string());
        }
    }
    let peak = peak(&act);
    if peak >= class.vram_gb {
        let (m, s) = models
            .iter()
            .zip(&act)
            .flat_map(|(m, a)| served.iter().map(move |&s| (m, s, a[s.index()])))
            .find(|x| x.2 >= class.vram_gb)
            .map(|(m, s, _)| (m.name.clone(), s.name()))
            .unwrap_or_default();
        return Err(format!(
            "{m} {s}: {peak:.1} GB of activations do not fit a {} ({:.0} GB) even tiled",
            class.name, class.vram_gb
        )
        .into());
    }
    // What stays resident: the DiT first (it runs every step), then the encoder, then the VAE.
    let mut budget = class.vram_gb - peak;
    let mut streamed = vec![[0.0f64; 3]; models.len()];
    for s in
        [Stage::Denoise, Stage::Encode, Stage::Decode].into_iter().filter(|s| served.contains(s))
    {
        for (i, m) in models.iter().enumerate() {
            let w = weights(m, s);
            let keep = w.min(budget);
            budget -= keep;
            streamed[i][s.index()] = w - keep;
        }
    }
    let all_three = served.len() == 3;
    let mut costs = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let measured = m.measured.iter().find(|x| x.class == class.name);
        let mut row = [None; 3];
        for &s in &served {
            let reference = [m.encode_ms, m.step_ms, m.decode_ms][s.index()];
            let cfg_share = if s == Stage::Denoise && m.cfg && !cfg { NO_CFG_STEP } else { 1.0 };
            let times = measured.map(|x| if all_three { x.colocated } else { x.alone });
            let cost = if let Some(ms) = times.and_then(|t| t.get(s)) {
                StageCost { ms: ms * cfg_share, mode: Mode::Measured }
            } else {
                let gb = streamed[i][s.index()];
                let compute = reference * cfg_share / class.speed;
                let mut ms = stream(s, gb, compute, class);
                let mode = if gb > 0.0 {
                    Mode::Offload(gb)
                } else if tiled && s == Stage::Decode {
                    ms *= TILE_TIME;
                    Mode::Tiled
                } else {
                    Mode::Resident
                };
                StageCost { ms, mode }
            };
            if let Mode::Offload(gb) = cost.mode {
                let per = if s == Stage::Denoise { "step" } else { "request" };
                notes.push(format!(
                    "{} {} streams {gb:.1} GB per {per} ({:.2} s)",
                    m.name,
                    s.name(),
                    cost.ms / 1e3
                ));
            }
            row[s.index()] = Some(cost);
        }
        if row.iter().flatten().any(|c| c.mode == Mode::Measured) {
            notes.push(format!("{} times measured on this class", m.name));
        }
        costs.push(row);
    }
    Ok(PoolFit { costs, notes })
}

/// The time of a forward whose `gb` of weights stream over the host link: the DiT prefetches
/// the next blocks while it computes (the step takes the longer of the two), the encoder and
/// the VAE load theirs before they run.
fn stream(s: Stage, gb: f64, compute_ms: f64, class: &GpuClass) -> f64 {
    let link_ms = gb / class.host_link_gbps * 1e3;
    match s {
        Stage::Denoise => compute_ms.max(link_ms),
        _ => compute_ms + link_ms / ONCE_OFFLOAD_EFFICIENCY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles;
    use crate::{classes, layout::Layout};

    fn setup(layout: &str, class: &str, model: &str) -> Result<PoolFit> {
        let all = profiles::load(None).unwrap();
        let classes = classes::load(None).unwrap();
        let m = profiles::pick(&all, &[model.to_string()]).unwrap();
        let l = Layout::parse(layout, class).unwrap();
        let c = classes::pick(&classes, class).unwrap();
        fit(&l.pools[0], c, &m, true)
    }

    #[test]
    fn a_pipeline_that_fits_is_resident() {
        let f = setup("EDV:1", "h200", "wan2.1-t2v-14b-480p").unwrap();
        assert!(f.costs[0].iter().all(|c| c.unwrap().mode == Mode::Resident), "{f:?}");
        // H200 speed 1.1: the H100 step time over 1.1.
        assert!((f.costs[0][1].unwrap().ms - 4950.0 / 1.1).abs() < 1e-6);
    }

    #[test]
    fn too_little_memory_offloads_the_encoder_first() {
        // 9.4 + 28 + 0.2 GB of weights and 8 GB of DiT activations on a 40 GB A100: the DiT
        // stays, 5.4 GB of the encoder streams once per request, and the whole VAE.
        let f = setup("EDV:1", "a100-40gb", "wan2.1-t2v-14b-480p").unwrap();
        let [e, d, v] = f.costs[0].map(Option::unwrap);
        assert_eq!(d.mode, Mode::Resident);
        let Mode::Offload(gb) = e.mode else { panic!("{e:?}") };
        assert!((gb - 5.4).abs() < 1e-9, "{gb}");
        assert!(matches!(v.mode, Mode::Offload(_)), "{v:?}");
        assert!(f.notes.iter().any(|n| n.contains("encode streams 5.4 GB")), "{:?}", f.notes);
        // Loaded before it runs, at a tenth of the 32 GB/s link: 840 ms / 0.45 + 1.69 s.
        assert!((e.ms - (840.0 / 0.45 + 5.4 / 3.2 * 1e3)).abs() < 1e-6, "{}", e.ms);
        // Alone, the encoder fits.
        let e = setup("E:1|DV:1", "a100-40gb", "wan2.1-t2v-14b-480p").unwrap();
        assert_eq!(e.costs[0][0].unwrap().mode, Mode::Resident);
    }

    #[test]
    fn measured_times_win_and_activations_that_never_fit_are_infeasible() {
        let f = setup("EDV:1", "rtx4090", "qwen-image-2512-8step").unwrap();
        assert_eq!(f.costs[0][0].unwrap().ms, 12890.0);
        assert_eq!(f.costs[0][1].unwrap().ms, 2900.0);
        assert!(matches!(f.costs[0][2].unwrap().mode, Mode::Offload(_)));
        let e = setup("EV:1|D:1", "rtx4090", "qwen-image-2512-8step").unwrap();
        assert_eq!(e.costs[0][0].unwrap().ms, 400.0);
        // HunyuanVideo at 720p on an 18 GB GPU: the VAE's 23.5 GB of activations tile to ~5.9 GB;
        // the DiT's 19.4 GB fit in no way.
        let all = profiles::load(None).unwrap();
        let m = profiles::pick(&all, &["hunyuanvideo-720p-129f".into()]).unwrap();
        let mut small = classes::load(None).unwrap()[0].clone();
        small.vram_gb = 18.0;
        let v = Layout::parse("V:1|ED:1", "x").unwrap();
        let f = fit(&v.pools[0], &small, &m, true).unwrap();
        assert_eq!(f.costs[0][2].unwrap().mode, Mode::Tiled, "{f:?}");
        let d = Layout::parse("D:1|EV:1", "x").unwrap();
        let e = fit(&d.pools[0], &small, &m, true).unwrap_err();
        assert!(e.0.contains("hunyuanvideo-720p-129f denoise: 19.4 GB of activations"), "{e}");
    }
}
