//! Layouts: the stages grouped into pools, each pool on a GPU class with a count. Written as
//! `E@l40s:1|DV@h100:7` (pools split by `|`; a pool's stages as letters E, D, V; `@class` optional,
//! defaulting to the run's `--gpu`; `:count` GPUs).

use std::fmt;

use crate::Result;
use tensorwire_orchestrator::Stage;

/// Stages as letters, in pipeline order.
const LETTERS: [char; 3] = ['E', 'D', 'V'];

/// One pool: the stages its GPUs serve, their class and how many.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    /// Which stages (by [`Stage::index`]).
    pub stages: [bool; 3],
    /// GPU class name.
    pub class: String,
    /// GPUs.
    pub count: u32,
}

impl Pool {
    /// The pool's stages in pipeline order, cut into runs of consecutive stages. A run is served
    /// as one item by one GPU (the stages of a run pass their tensors on the GPU, no transfer);
    /// runs apart (E and V without D) are separate items that share the pool's GPUs.
    pub fn runs(&self) -> Vec<Vec<Stage>> {
        let mut runs: Vec<Vec<Stage>> = Vec::new();
        let mut last: Option<usize> = None;
        for s in Stage::ALL.into_iter().filter(|s| self.stages[s.index()]) {
            match runs.last_mut() {
                Some(r) if last == Some(s.index().wrapping_sub(1)) => r.push(s),
                _ => runs.push(vec![s]),
            }
            last = Some(s.index());
        }
        runs
    }

    /// The stages as letters ("DV").
    pub fn letters(&self) -> String {
        LETTERS.iter().zip(self.stages).filter(|(_, on)| *on).map(|(c, _)| *c).collect()
    }
}

/// Pools covering each stage once.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// The pools.
    pub pools: Vec<Pool>,
}

impl Layout {
    /// Parses `E@l40s:1|DV:7`; `class` is the class of a pool that names none.
    pub fn parse(s: &str, class: &str) -> Result<Layout> {
        let bad = |why: String| format!("--layout {s:?}: {why} (e.g. E@l40s:1|DV@h100:7)");
        let mut pools = Vec::new();
        let mut seen = [false; 3];
        for part in s.split('|') {
            let (stages, count) = part
                .trim()
                .rsplit_once(':')
                .ok_or_else(|| bad(format!("{part:?} has no :count")))?;
            let count: u32 = count
                .trim()
                .parse()
                .ok()
                .filter(|&n| (1..=100_000).contains(&n))
                .ok_or_else(|| bad(format!("{count:?} is not a GPU count in 1..=100000")))?;
            let (letters, cls) = stages.split_once('@').unwrap_or((stages, class));
            let mut on = [false; 3];
            for c in letters.trim().chars() {
                let i = LETTERS
                    .iter()
                    .position(|&l| l == c.to_ascii_uppercase())
                    .ok_or_else(|| bad(format!("{c:?} is not a stage (E, D or V)")))?;
                if std::mem::replace(&mut seen[i], true) {
                    return Err(bad(format!("stage {} is in two pools", LETTERS[i])).into());
                }
                on[i] = true;
            }
            if !on.contains(&true) {
                return Err(bad(format!("{part:?} serves no stage")).into());
            }
            pools.push(Pool { stages: on, class: cls.trim().to_string(), count });
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return Err(bad(format!("no pool serves stage {}", LETTERS[i])).into());
        }
        Ok(Layout { pools })
    }

    /// GPUs in all pools.
    pub fn gpus(&self) -> u32 {
        self.pools.iter().map(|p| p.count).sum()
    }

    /// The grouping without classes and counts ("E|DV").
    #[cfg(test)]
    pub fn kind(&self) -> String {
        self.pools.iter().map(Pool::letters).collect::<Vec<_>>().join("|")
    }

    /// Every stage on one pool.
    pub fn colocated(&self) -> bool {
        self.pools.len() == 1
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> =
            self.pools.iter().map(|p| format!("{}@{}:{}", p.letters(), p.class, p.count)).collect();
        f.write_str(&parts.join("|"))
    }
}

/// The stages named by letters known to be valid (the constants below).
pub fn stages(letters: &str) -> [bool; 3] {
    std::array::from_fn(|i| letters.contains(LETTERS[i]))
}

/// Every way to group the three stages into pools (the set partitions of {E, D, V}).
pub const GROUPINGS: [&[&str]; 5] =
    [&["EDV"], &["E", "DV"], &["ED", "V"], &["EV", "D"], &["E", "D", "V"]];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_and_print() {
        let l = Layout::parse("E@l40s:1|DV:7", "h100").unwrap();
        assert_eq!(l.to_string(), "E@l40s:1|DV@h100:7");
        assert_eq!((l.gpus(), l.kind()), (8, "E|DV".to_string()));
        assert_eq!(l.pools[1].runs(), vec![vec![Stage::Denoise, Stage::Decode]]);
        let ev = Layout::parse("ve:2|d:6", "rtx4090").unwrap();
        assert_eq!(ev.kind(), "EV|D");
        assert_eq!(ev.pools[0].runs(), vec![vec![Stage::Encode], vec![Stage::Decode]]);
        assert!(Layout::parse("EDV:8", "h100").unwrap().colocated());
        for (bad, why) in [
            ("E:1|D:7", "no pool serves stage V"),
            ("ED:1|DV:7", "stage D is in two pools"),
            ("EDV", "has no :count"),
            ("EDV:0", "not a GPU count"),
            ("EXV:1", "not a stage"),
        ] {
            let e = Layout::parse(bad, "h100").unwrap_err();
            assert!(e.0.contains(why), "{bad}: {e}");
        }
        for g in GROUPINGS {
            let s: Vec<String> = g.iter().map(|p| format!("{p}:1")).collect();
            assert_eq!(Layout::parse(&s.join("|"), "h100").unwrap().kind(), g.join("|"));
        }
    }
}
