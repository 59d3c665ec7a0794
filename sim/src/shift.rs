//! Shifting workloads for `simulate --elastic`: `--phases` takes `MIX@RATE:SECONDS;...`, each
//! MIX in the `--mix` syntax (see [`super::workload`]), RATE in requests per second, SECONDS the
//! phase's length; e.g. `qwen-image-1328@0.5:3600;wan2.1-t2v-1.3b-480p@0.3:3600`. The phases'
//! models become one mix (an entry per model and class); each phase keeps its shares of it.

use std::time::Duration;

use super::engine::{Phase, Shift};
use super::workload::{Entry, Mix};
use crate::Result;
use crate::profiles::Model;

/// Parses `--phases` against the profiles: the union mix and the shift over it.
pub fn parse(s: &str, all: &[Model]) -> Result<(Mix, Shift)> {
    let bad = |why: String| format!("--phases {s:?}: {why}");
    let mut union: Vec<Entry> = Vec::new();
    let mut parsed = Vec::new();
    for part in s.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (mix, tail) = part
            .rsplit_once('@')
            .ok_or_else(|| bad(format!("{part:?}: expected MIX@RATE:SECONDS")))?;
        let (rate, secs) =
            tail.split_once(':').ok_or_else(|| bad(format!("{tail:?}: expected RATE:SECONDS")))?;
        let rate: f64 = rate.trim().parse().map_err(|_| bad(format!("{rate:?} is not a rate")))?;
        let secs: f64 =
            secs.trim().parse().map_err(|_| bad(format!("{secs:?} is not a length in seconds")))?;
        let ok = |x: f64, max: f64| x.is_finite() && x > 0.0 && x <= max;
        if !ok(rate, f64::MAX) || !ok(secs, 1e7) {
            return Err(bad(format!(
                "{part:?}: the rate must be > 0 and the length in (0, 1e7] s"
            ))
            .into());
        }
        let m = Mix::parse(mix, all)?;
        let mut shares = Vec::new();
        for e in m.entries {
            let i = match union
                .iter()
                .position(|u| u.model.name == e.model.name && u.priority == e.priority)
            {
                Some(i) => i,
                None => {
                    union.push(Entry { share: 0.0, ..e.clone() });
                    union.len() - 1
                }
            };
            shares.push((i, e.share));
        }
        parsed.push((shares, rate, Duration::from_secs_f64(secs)));
    }
    if parsed.is_empty() {
        return Err(bad("no phases".into()).into());
    }
    let n = union.len();
    let phases: Vec<Phase> = parsed
        .into_iter()
        .map(|(sh, rate, length)| {
            let mut shares = vec![0.0; n];
            for (i, x) in sh {
                shares[i] += x;
            }
            Phase { shares, rate, length }
        })
        .collect();
    // The union's own shares: by requests over the whole shift (for describing it).
    let total: f64 = phases.iter().map(|p| p.rate * p.length.as_secs_f64()).sum();
    for (i, e) in union.iter_mut().enumerate() {
        e.share = phases.iter().map(|p| p.shares[i] * p.rate * p.length.as_secs_f64()).sum::<f64>()
            / total;
    }
    Ok((Mix { entries: union }, Shift { phases }))
}

impl Shift {
    /// The first `n` phases alone.
    pub fn first(&self, n: usize) -> Shift {
        Shift { phases: self.phases[..n.min(self.phases.len())].to_vec() }
    }

    /// One line per phase: what it asks, against `mix`'s entries.
    pub fn describe(&self, mix: &Mix) -> Vec<String> {
        self.phases
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let parts: Vec<String> = p
                    .shares
                    .iter()
                    .zip(&mix.entries)
                    .filter(|(s, _)| **s > 0.0)
                    .map(|(s, e)| format!("{} {:.0}%", e.model.name, s * 100.0))
                    .collect();
                format!(
                    "phase {}: {} at {:.3} req/s for {:.0} s",
                    i + 1,
                    parts.join(" + "),
                    p.rate,
                    p.length.as_secs_f64()
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles;

    #[test]
    fn phases_parse_into_one_mix() {
        let all = profiles::load(None).unwrap();
        let (mix, sh) =
            parse("qwen-image-1328@0.5:100; qwen-image-1328=1,wan2.1-t2v-1.3b-480p=3@1:100", &all)
                .unwrap();
        assert_eq!(mix.entries.len(), 2);
        assert_eq!(sh.phases.len(), 2);
        assert_eq!(sh.phases[0].shares, vec![1.0, 0.0]);
        assert_eq!(sh.phases[1].shares, vec![0.25, 0.75]);
        // 50 + 25 qwen requests, 75 wan: by requests over the shift.
        assert!((mix.entries[0].share - 0.5).abs() < 1e-12);
        for (bad, why) in [
            ("qwen-image-1328", "expected MIX@RATE:SECONDS"),
            ("qwen-image-1328@1", "expected RATE:SECONDS"),
            ("qwen-image-1328@0:10", "must be > 0"),
            ("qwen-image-1328@1:x", "not a length"),
            ("nope@1:10", "unknown model"),
            ("", "no phases"),
        ] {
            let e = parse(bad, &all).unwrap_err();
            assert!(e.0.contains(why), "{bad}: {e}");
        }
    }
}
