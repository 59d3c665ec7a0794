//! Liveness and readiness: what `/healthz` and `/readyz` answer.

use std::sync::Arc;

use parking_lot::Mutex;

type Check = Arc<dyn Fn() -> bool + Send + Sync>;
type Targets = Arc<dyn Fn() -> Vec<Target> + Send + Sync>;

/// Another process's metrics endpoint this one knows of (a worker that joined this process's
/// orchestrator), with labels that say what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Its address (`host:port`).
    pub addr: String,
    /// Labels, e.g. `("stage", "denoise")`.
    pub labels: Vec<(String, String)>,
}

/// The readiness checks of a process: each a name and a function that says whether that part
/// is ready (the engine started, the orchestrator joined, the store node reachable). Cloning
/// shares the checks.
#[derive(Clone, Default)]
pub struct Health {
    checks: Arc<Mutex<Vec<(String, Check)>>>,
    targets: Arc<Mutex<Option<Targets>>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.checks.lock().iter().map(|(n, _)| n.clone()).collect();
        f.debug_struct("Health").field("checks", &names).finish()
    }
}

impl Health {
    /// No checks: ready.
    pub fn new() -> Health {
        Health::default()
    }

    /// Adds (or replaces) the check `name`.
    pub fn check(&self, name: &str, ready: impl Fn() -> bool + Send + Sync + 'static) {
        let mut c = self.checks.lock();
        c.retain(|(n, _)| n != name);
        c.push((name.to_string(), Arc::new(ready)));
    }

    /// Says where the endpoints of the processes this one knows of are (`/sd` lists them).
    pub fn targets(&self, list: impl Fn() -> Vec<Target> + Send + Sync + 'static) {
        *self.targets.lock() = Some(Arc::new(list));
    }

    /// The known endpoints (empty without a list).
    pub fn known_targets(&self) -> Vec<Target> {
        let list = self.targets.lock().clone();
        list.map_or_else(Vec::new, |f| f())
    }

    /// The names of the checks that fail now (empty: ready). The checks run outside the lock.
    pub fn failing(&self) -> Vec<String> {
        let checks: Vec<(String, Check)> = self.checks.lock().clone();
        checks.into_iter().filter(|(_, ok)| !ok()).map(|(n, _)| n).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn failing_names_exactly_the_checks_that_fail() {
        let h = Health::new();
        assert!(h.failing().is_empty(), "no checks: ready");
        let joined = Arc::new(AtomicBool::new(false));
        let j = joined.clone();
        h.check("joined", move || j.load(Ordering::Relaxed));
        h.check("engine", || true);
        assert_eq!(h.failing(), ["joined"]);
        joined.store(true, Ordering::Relaxed);
        assert!(h.failing().is_empty());
        h.check("engine", || false);
        assert_eq!(h.failing(), ["engine"], "a check of the same name is replaced");
    }
}
