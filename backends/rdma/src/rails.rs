//! The health of one rail (a QP between a local and a remote NIC), as a plain state machine with
//! time passed in: up; down after a path failure, paused with exponential backoff, then rebuilt
//! (a new QP) once the old one has no request left; rebuilding at once after an error that says
//! nothing about the path (a refused access moves the QP to ERROR too).

use std::time::{Duration, Instant};

/// Backoff bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Pause after the first failure.
    pub first: Duration,
    /// Longest pause.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { first: Duration::from_millis(50), max: Duration::from_secs(5) }
    }
}

/// Where a rail is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Carries requests.
    Up,
    /// Failed; not to be rebuilt before `until`.
    Paused {
        /// End of the pause.
        until: Instant,
    },
    /// A new QP is being made (nothing is posted meanwhile).
    Rebuilding,
}

/// One rail's health and failure history.
#[derive(Debug, Clone)]
pub struct RailHealth {
    state: Health,
    /// Consecutive failures (reset by a success).
    failures: u32,
    backoff: Backoff,
}

impl RailHealth {
    /// A rail that is up.
    pub fn new(backoff: Backoff) -> RailHealth {
        RailHealth { state: Health::Up, failures: 0, backoff }
    }

    /// Where it is.
    pub fn state(&self) -> Health {
        self.state
    }

    /// Whether requests may be posted on it.
    pub fn usable(&self) -> bool {
        self.state == Health::Up
    }

    /// Whether it failed on its path (paused), as opposed to up or being rebuilt.
    pub fn is_paused(&self) -> bool {
        matches!(self.state, Health::Paused { .. })
    }

    /// Consecutive failures.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// A path failure at `now`: paused for the backoff of this many failures in a row.
    pub fn failed(&mut self, now: Instant) {
        self.failures = self.failures.saturating_add(1);
        let exp = self.failures.saturating_sub(1).min(16);
        let pause = self.backoff.first.saturating_mul(1 << exp).min(self.backoff.max);
        self.state = Health::Paused { until: now + pause };
    }

    /// The QP failed for a reason that is not the path's: rebuild at once.
    pub fn qp_lost(&mut self) {
        if self.state == Health::Up {
            self.state = Health::Rebuilding;
        }
    }

    /// Whether a rebuild may start now (paused long enough, or waiting to be rebuilt).
    pub fn due(&self, now: Instant) -> bool {
        match self.state {
            Health::Paused { until } => now >= until,
            Health::Rebuilding => true,
            Health::Up => false,
        }
    }

    /// A rebuild started.
    pub fn rebuilding(&mut self) {
        self.state = Health::Rebuilding;
    }

    /// The rebuild ended: up again, or failed (paused longer).
    pub fn rebuilt(&mut self, ok: bool, now: Instant) {
        if ok {
            self.state = Health::Up;
        } else {
            self.failed(now);
        }
    }

    /// A request succeeded on it: the failure streak is over.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// When it wants attention next (the end of its pause).
    pub fn wake_at(&self) -> Option<Instant> {
        match self.state {
            Health::Paused { until } => Some(until),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_bound_and_a_success_resets_it() {
        let t0 = Instant::now();
        let b = Backoff { first: Duration::from_millis(10), max: Duration::from_millis(35) };
        let mut r = RailHealth::new(b);
        assert!(r.usable() && !r.due(t0));
        let mut pauses = Vec::new();
        for _ in 0..4 {
            r.failed(t0);
            let Health::Paused { until } = r.state() else { panic!("paused") };
            pauses.push(until - t0);
            assert!(!r.usable() && !r.due(t0) && r.due(until));
        }
        assert_eq!(pauses, [10, 20, 35, 35].map(Duration::from_millis));
        r.rebuilding();
        assert!(!r.usable());
        r.rebuilt(false, t0);
        assert_eq!(r.failures(), 5);
        r.rebuilt(true, t0);
        assert!(r.usable());
        r.succeeded();
        r.failed(t0);
        assert_eq!(r.wake_at(), Some(t0 + Duration::from_millis(10)));
    }

    #[test]
    fn a_lost_qp_is_rebuilt_at_once() {
        let t0 = Instant::now();
        let mut r = RailHealth::new(Backoff::default());
        r.qp_lost();
        assert!(!r.usable() && r.due(t0) && !r.is_paused());
        r.rebuilt(true, t0);
        assert!(r.usable() && r.failures() == 0);
    }
}
