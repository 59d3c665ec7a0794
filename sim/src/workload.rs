//! Workloads: a mix of models and request classes. `--mix` takes
//! `MODEL[=SHARE][:interactive|:batch],...`, e.g. `flux.1-dev-1024=0.7:interactive,
//! wan2.1-t2v-14b-480p=0.3:batch`; shares are normalised; an entry with no class is batch, or
//! interactive for the `--interactive` share of its requests.

use tensorwire_orchestrator::Priority;

use crate::Result;
use crate::profiles::{self, Model};

/// One kind of request in the mix.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The model.
    pub model: Model,
    /// Share of the arrivals (the entries' shares sum to 1).
    pub share: f64,
    /// Its class, if the entry fixes one.
    pub priority: Option<Priority>,
}

/// The index drawn by `u` in [0, 1) among `shares` (summing to 1): the first whose running sum
/// passes `u`, else the last.
pub fn pick(shares: impl ExactSizeIterator<Item = f64>, u: f64) -> usize {
    let n = shares.len();
    let mut acc = 0.0;
    for (i, s) in shares.enumerate() {
        acc += s;
        if u < acc {
            return i;
        }
    }
    n.saturating_sub(1)
}

/// The workload's mix.
#[derive(Debug, Clone)]
pub struct Mix {
    /// Entries (at least one).
    pub entries: Vec<Entry>,
}

impl Mix {
    /// One model, every request of it.
    pub fn single(m: Model) -> Mix {
        Mix { entries: vec![Entry { model: m, share: 1.0, priority: None }] }
    }

    /// Parses `--mix` against the profiles.
    pub fn parse(s: &str, all: &[Model]) -> Result<Mix> {
        let bad = |why: String| format!("--mix {s:?}: {why}");
        let mut entries = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (rest, priority) = match part.rsplit_once(':') {
                Some((r, "interactive")) => (r, Some(Priority::Interactive)),
                Some((r, "batch")) => (r, Some(Priority::Batch)),
                Some((_, c)) => {
                    return Err(bad(format!("{c:?}: expected interactive or batch")).into());
                }
                None => (part, None),
            };
            let (name, share) = match rest.split_once('=') {
                Some((n, x)) => {
                    let v: f64 = x.parse().map_err(|_| bad(format!("{x:?} is not a share")))?;
                    (n, v)
                }
                None => (rest, 1.0),
            };
            if !(share.is_finite() && share > 0.0) {
                return Err(bad(format!("{name}: share {share} must be > 0")).into());
            }
            let model = profiles::pick(all, &[name.to_string()])?[0].clone();
            entries.push(Entry { model, share, priority });
        }
        if entries.is_empty() {
            return Err(bad("no entries".into()).into());
        }
        let total: f64 = entries.iter().map(|e| e.share).sum();
        for e in &mut entries {
            e.share /= total;
        }
        Ok(Mix { entries })
    }

    /// The models, in entry order.
    pub fn models(&self) -> Vec<&Model> {
        self.entries.iter().map(|e| &e.model).collect()
    }

    /// The entry for a draw `u` in [0, 1).
    pub fn pick(&self, u: f64) -> usize {
        pick(self.entries.iter().map(|e| e.share), u)
    }

    /// A name for the mix ("flux.1-dev-1024 70% interactive + ...").
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .entries
            .iter()
            .map(|e| {
                let class = match e.priority {
                    Some(Priority::Interactive) => " interactive",
                    Some(Priority::Batch) => " batch",
                    None => "",
                };
                if self.entries.len() == 1 {
                    format!("{}{class}", e.model.name)
                } else {
                    format!("{} {:.0}%{class}", e.model.name, e.share * 100.0)
                }
            })
            .collect();
        parts.join(" + ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_parse() {
        let all = profiles::load(None).unwrap();
        let m =
            Mix::parse("flux.1-dev-1024=3:interactive, wan2.1-t2v-14b-480p=1:batch", &all).unwrap();
        assert_eq!(m.entries.len(), 2);
        assert!((m.entries[0].share - 0.75).abs() < 1e-12);
        assert_eq!(m.entries[1].priority, Some(Priority::Batch));
        assert_eq!((m.pick(0.5), m.pick(0.9)), (0, 1));
        assert!(m.describe().contains("flux.1-dev-1024 75% interactive"));
        for (bad, why) in [
            ("flux.1-dev-1024:urgent", "expected interactive or batch"),
            ("flux.1-dev-1024=-1", "must be > 0"),
            ("nope", "unknown model"),
            ("", "no entries"),
        ] {
            let e = Mix::parse(bad, &all).unwrap_err();
            assert!(e.0.contains(why), "{bad}: {e}");
        }
    }
}
