//! Every family a process records, exported from its start: counters and gauges at zero and
//! histograms empty, for each of their known label values. Prometheus' guidance is to export
//! every series a process knows of from the start, so that a dashboard or an alert on a rate
//! (or on an absent series) sees a zero, not a hole, before the first event.
//!
//! The label values are the ones the recording code can write: stages, classes, outcomes,
//! directions, payload kinds, error kinds, and the process's own backends. A value recorded
//! later that is not listed here (a cache kind a caller names) appears when it is first
//! recorded, as before.

use tensorwire_proto::error::Error;

use crate::families::{FAMILIES, Family, Kind};

/// The layers of [`Family::recorded_by`] a process runs, to export at zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    /// A transfer engine, with these backends' names.
    Engine(&'static [&'static str]),
    /// A store (embedded or served by a node).
    Store,
    /// A diffusion connector.
    Connector,
    /// An orchestrator.
    Orchestrator,
}

impl Layer {
    fn name(self) -> &'static str {
        match self {
            Layer::Engine(_) => "engine",
            Layer::Store => "store",
            Layer::Connector => "connector",
            Layer::Orchestrator => "orchestrator",
        }
    }
}

const STAGES: &[&str] = &["encode", "denoise", "decode"];
const CLASSES: &[&str] = &["interactive", "batch"];
/// `tensorwire_diffusion::PayloadKind::name`'s values.
const PAYLOAD_KINDS: &[&str] = &["embedding", "latent", "step_latent", "feature"];

/// The values label `label` of `family` takes, `backends` being the process's.
fn values(family: &str, label: &str, backends: &[&'static str]) -> Vec<&'static str> {
    match (family, label) {
        (_, "backend") => backends.to_vec(),
        ("tensorwire_handoff_bytes_total", "direction") => vec!["in", "out"],
        ("tensorwire_staging_bounces_total", "direction") => vec!["read", "write", "serve"],
        (_, "direction") => vec!["read", "write"],
        ("tensorwire_transfer_errors_total", "kind") => Error::KINDS.to_vec(),
        (_, "kind") => PAYLOAD_KINDS.to_vec(),
        (_, "result") => vec!["hit", "miss"],
        (_, "stage" | "from" | "to") => STAGES.to_vec(),
        (_, "class") => CLASSES.to_vec(),
        (_, "outcome") => vec!["completed", "failed"],
        (_, "state") => vec!["live", "draining"],
        _ => Vec::new(),
    }
}

/// Every label set of `fam`: the product of its labels' values (a switch from a stage to
/// itself left out). Empty when a label has no known value.
fn label_sets(fam: &Family, backends: &[&'static str]) -> Vec<Vec<(&'static str, &'static str)>> {
    let mut sets: Vec<Vec<(&'static str, &'static str)>> = vec![Vec::new()];
    for label in fam.labels.split(',').filter(|l| !l.is_empty()) {
        let vals = values(fam.name, label, backends);
        sets = sets
            .into_iter()
            .flat_map(|set| {
                vals.iter().map(move |&v| {
                    let mut s = set.clone();
                    s.push((label, v));
                    s
                })
            })
            .collect();
    }
    sets.retain(|s| {
        let get = |k| s.iter().find(|(l, _)| *l == k).map(|(_, v)| *v);
        get("from").is_none() || get("from") != get("to")
    });
    sets
}

/// Registers every family of `layers` (see the module docs) with the installed recorder:
/// counters and gauges are touched with a zero increment (a value already recorded stays),
/// histograms are registered empty. Call it after [`crate::install`]; without a recorder it
/// does nothing.
pub fn export_at_zero(layers: &[Layer]) {
    for layer in layers {
        let backends = match layer {
            Layer::Engine(b) => *b,
            _ => &[],
        };
        for fam in FAMILIES.iter().filter(|f| f.recorded_by == layer.name()) {
            for set in label_sets(fam, backends) {
                let labels: Vec<metrics::Label> =
                    set.iter().map(|&(k, v)| metrics::Label::new(k, v)).collect();
                let key = metrics::Key::from_parts(fam.name, labels);
                let meta = metrics::Metadata::new(module_path!(), metrics::Level::INFO, None);
                metrics::with_recorder(|r| match fam.kind {
                    Kind::Counter => r.register_counter(&key, &meta).increment(0),
                    Kind::Gauge => r.register_gauge(&key, &meta).increment(0.0),
                    Kind::Histogram => drop(r.register_histogram(&key, &meta)),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn family(name: &str) -> &'static Family {
        FAMILIES.iter().find(|f| f.name == name).unwrap()
    }

    #[test]
    fn label_sets_are_the_product_of_known_values() {
        let sets = label_sets(family("tensorwire_transfer_ops_total"), &["tcp", "shm"]);
        assert_eq!(sets.len(), 4, "{sets:?}");
        assert!(sets.contains(&vec![("backend", "shm"), ("direction", "write")]));
        let sets = label_sets(family("tensorwire_switches_total"), &[]);
        assert_eq!(sets.len(), 6, "three stages, no switch to itself: {sets:?}");
        let sets = label_sets(family("tensorwire_transfers_in_flight"), &[]);
        assert_eq!(sets, vec![Vec::new()], "no label: one series");
        let sets = label_sets(family("tensorwire_transfer_errors_total"), &[]);
        assert!(sets.is_empty(), "no backend, no series");
    }

    #[test]
    fn every_label_of_every_family_has_values_but_the_open_ones() {
        for fam in FAMILIES {
            for label in fam.labels.split(',').filter(|l| !l.is_empty()) {
                let open = matches!(label, "cache" | "version" | "process" | "backend");
                assert_eq!(
                    values(fam.name, label, &[]).is_empty(),
                    open,
                    "{}'s label {label}",
                    fam.name
                );
            }
        }
    }
}
