//! `tensorwire simulate --elastic`: a shifting workload (`--phases`) on one GPU class, served by
//! elastic pools (the orchestrator's rebalancer moving GPUs between the E, D and V pools, each
//! switch paying the time to load the new stage's weights) against two static splits on the
//! same GPUs: the best split for the first phase (chosen once, for yesterday's traffic) and the
//! best split for the whole run (which needs to know the future).

use std::time::Duration;

use tensorwire_orchestrator::sched::SchedConfig;

use crate::report::percentile;
use crate::simulate::{Ctx, SimArgs, context, per_1k, show, splits};
use tensorwire_sim::engine::{self, Elastic, Knobs, Load, Outcome, Prepared, Shift};
use tensorwire_sim::layout::Layout;
use tensorwire_sim::profiles::Model;
use tensorwire_sim::shift;
use tensorwire_sim::workload::Mix;

/// One run of the comparison.
pub(crate) struct Row {
    /// What it is.
    pub(crate) label: String,
    /// Its layout (the starting one, for the elastic run).
    pub(crate) prepared: Prepared,
    /// What it measured.
    pub(crate) run: Outcome,
}

/// What `simulate --elastic` found.
pub(crate) struct Figures {
    /// The union mix and the shift.
    pub(crate) mix: Mix,
    pub(crate) shift: Shift,
    /// Time to switch a GPU to each stage.
    pub(crate) switch: [Duration; 3],
    /// Static for the first phase, static for the whole run, elastic.
    pub(crate) rows: Vec<Row>,
}

/// The p99 TTFF of a run, seconds (what the comparison ranks by).
fn p99(o: &Outcome) -> f64 {
    percentile(&o.ttff, 99.0).as_secs_f64()
}

/// Runs the comparison.
pub(crate) fn figures(cx: &Ctx, all: &[Model]) -> anyhow::Result<Figures> {
    let a = &cx.a;
    let spec = a
        .phases
        .as_deref()
        .ok_or_else(|| anyhow::Error::msg("--elastic needs --phases MIX@RATE:SECONDS;..."))?;
    let (mix, shift) = shift::parse(spec, all)?;
    let switch = a.switch.times(mix.entries.iter().map(|e| &e.model))?;
    let cfg = a.rebalance.config(1.0, SchedConfig::default().decode_headroom)?;
    let knobs: &Knobs = &cx.knobs;
    let prepare = |l: &str| Prepared::new(&Layout::parse(l, &a.gpu)?, &cx.classes, &mix, knobs.cfg);
    let run = |p: &Prepared, sh: &Shift, el: Option<&Elastic>| {
        engine::simulate_with(p, &mix, knobs, Load::Saturated { requests: 0 }, Some(sh), el)
    };
    // The best static split for the first phase alone, and for the whole run.
    let first = shift.first(1);
    let mut best_first: Option<(Prepared, f64)> = None;
    let mut best_whole: Option<(Prepared, Outcome)> = None;
    for s in splits(a.split.as_deref(), cx.gpus())? {
        let Ok(p) = prepare(&s) else { continue };
        let f = p99(&run(&p, &first, None)?);
        if best_first.as_ref().is_none_or(|(_, b)| f < *b) {
            best_first = Some((p.clone(), f));
        }
        let w = run(&p, &shift, None)?;
        if best_whole.as_ref().is_none_or(|(_, b)| p99(&w) < p99(b)) {
            best_whole = Some((p, w));
        }
    }
    let (pf, _) = best_first.ok_or_else(|| anyhow::Error::msg("no split fits the GPUs"))?;
    let (pw, ow) = best_whole.ok_or_else(|| anyhow::Error::msg("no split fits the GPUs"))?;
    let of = run(&pf, &shift, None)?;
    let el = Elastic { cfg, switch };
    let oe = run(&pf, &shift, Some(&el))?;
    let rows = vec![
        Row {
            label: format!("static, best for phase 1 ({})", pf.layout),
            prepared: pf.clone(),
            run: of,
        },
        Row { label: format!("static, best for the run ({})", pw.layout), prepared: pw, run: ow },
        Row { label: format!("elastic from {}", pf.layout), prepared: pf, run: oe },
    ];
    Ok(Figures { mix, shift, switch, rows })
}

/// `simulate --elastic`: prints the phases, the three runs, the moves and the comparison.
pub(crate) fn run(a: SimArgs) -> anyhow::Result<()> {
    let (cx, all) = context(a)?;
    let cx = &cx;
    let f = figures(cx, &all)?;
    let requests = f.rows[0].run.e2e.len();
    println!(
        "tensorwire simulate --elastic: {} GPUs of {}, {requests} requests over {} phases; switching a GPU to encode / denoise / decode takes {:.1} / {:.1} / {:.1} s",
        cx.gpus(),
        cx.a.gpu,
        f.shift.phases.len(),
        f.switch[0].as_secs_f64(),
        f.switch[1].as_secs_f64(),
        f.switch[2].as_secs_f64()
    );
    for line in f.shift.describe(&f.mix) {
        println!("  {line}");
    }
    for r in &f.rows {
        show(&r.label, &r.prepared, &r.run, cx.target);
    }
    let e = &f.rows[2].run;
    let switching = e.moves.iter().map(|m| (m.joined - m.at).as_secs_f64()).fold(0.0, |a, b| a + b);
    println!(
        "elastic: {} moves, {:.0} GPU-seconds draining and switching ({:.2}% of the GPU time)",
        e.moves.len(),
        switching,
        100.0 * switching / (f64::from(cx.gpus()) * span(e)).max(1e-9)
    );
    for m in e.moves.iter().take(MOVES_SHOWN) {
        println!(
            "  at {:>8.0} s: GPU {} {} -> {} (serving again at {:.0} s)",
            m.at.as_secs_f64(),
            m.gpu,
            m.from,
            m.to,
            m.joined.as_secs_f64()
        );
    }
    if e.moves.len() > MOVES_SHOWN {
        println!("  ... and {} more", e.moves.len() - MOVES_SHOWN);
    }
    let usd = f.rows[0].prepared.usd_per_hour;
    for r in &f.rows[..2] {
        println!(
            "elastic vs {}: p99 TTFF {:.1} s vs {:.1} s ({:.2}x), p50 {:.1} s vs {:.1} s, throughput {:.4} vs {:.4} req/s, ${:.2} vs ${:.2} per 1k requests",
            r.label,
            p99(e),
            p99(&r.run),
            p99(e) / p99(&r.run).max(1e-12),
            percentile(&e.ttff, 50.0).as_secs_f64(),
            percentile(&r.run.ttff, 50.0).as_secs_f64(),
            e.throughput,
            r.run.throughput,
            per_1k(usd, e.throughput),
            per_1k(usd, r.run.throughput)
        );
    }
    Ok(())
}

/// Seconds a run lasted (from its throughput).
fn span(o: &Outcome) -> f64 {
    o.e2e.len() as f64 / o.throughput.max(1e-12)
}

/// Moves printed, at most.
const MOVES_SHOWN: usize = 20;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::context_of;
    use tensorwire_orchestrator::Stage;

    #[test]
    fn elastic_pools_follow_a_shift_to_video_and_back() {
        let (cx, all) = context_of(&[
            "--elastic",
            "--gpus",
            "16",
            "--phases",
            "qwen-image-1328@0.58:1200;wan2.1-t2v-1.3b-480p@0.28:1200;qwen-image-1328@0.58:1200",
        ])
        .unwrap();
        let f = figures(&cx, &all).unwrap();
        let n = f.rows[0].run.e2e.len();
        assert!(n > 1000, "{n}");
        assert!(f.rows.iter().all(|r| r.run.e2e.len() == n), "every run completes every request");
        let [first, _, elastic] = &f.rows[..] else { panic!() };
        assert_eq!(first.prepared.layout.to_string(), "E@h100:1|D@h100:14|V@h100:1");
        // Video needs more decode than images: a denoiser moves over during the second phase,
        // and one moves back in the third.
        let moves = &elastic.run.moves;
        let secs = |d: Duration| d.as_secs_f64();
        assert!(
            moves.iter().any(|m| m.to == Stage::Decode && (1200.0..2400.0).contains(&secs(m.at))),
            "{moves:?}"
        );
        assert!(moves.iter().any(|m| m.to == Stage::Denoise && secs(m.at) >= 1200.0), "{moves:?}");
        assert!(moves.iter().all(|m| m.joined > m.at), "a switch takes time");
        assert!(p99(&elastic.run) < p99(&first.run), "elastic beats the split for phase 1");
        let e = figures(&context_of(&["--elastic"]).unwrap().0, &all).err().unwrap();
        assert!(e.to_string().contains("--elastic needs --phases"), "{e}");
    }
}
