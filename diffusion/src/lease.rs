//! A lease's state machine: plain data, time passed in. The connector keeps one per p2p payload;
//! the store keeps the same rules for store-relayed payloads.

use std::time::Instant;

use tensorwire_core::{Error, Missing, Result};

use crate::payload::LeasePolicy;

/// Where a lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// The payload may be served.
    Live,
    /// Every expected consumer finished: free it.
    Consumed,
    /// Its time ran out: free it.
    Expired,
}

/// A lease on one published payload.
#[derive(Debug, Clone)]
pub struct Lease {
    policy: LeasePolicy,
    remaining: u32,
    expires: Option<Instant>,
    state: LeaseState,
}

impl Lease {
    /// A lease starting at `now`.
    pub fn new(policy: LeasePolicy, now: Instant) -> Lease {
        let (remaining, expires) = match policy {
            LeasePolicy::DeleteOnConsume { consumers } => (consumers.max(1), None),
            LeasePolicy::Ttl(d) => (0, now.checked_add(d)),
            LeasePolicy::SoftPin | LeasePolicy::Pinned => (0, None),
        };
        Lease { policy, remaining, expires, state: LeaseState::Live }
    }

    /// The policy.
    pub fn policy(&self) -> LeasePolicy {
        self.policy
    }

    /// The state at `now` (expiry applied).
    pub fn state(&mut self, now: Instant) -> LeaseState {
        if self.state == LeaseState::Live && self.expires.is_some_and(|t| now >= t) {
            self.state = LeaseState::Expired;
        }
        self.state
    }

    /// Whether the payload may be served at `now`; the error says why not.
    pub fn check(&mut self, now: Instant, what: &str) -> Result<()> {
        match self.state(now) {
            LeaseState::Live => Ok(()),
            LeaseState::Consumed => Err(Error::NotFound(Missing::Other(format!(
                "{what}: already consumed by every expected consumer"
            )))),
            LeaseState::Expired => {
                Err(Error::NotFound(Missing::Other(format!("{what}: lease expired"))))
            }
        }
    }

    /// One consumer finished at `now`; returns the new state.
    pub fn consume(&mut self, now: Instant) -> LeaseState {
        if self.state(now) == LeaseState::Live && self.remaining > 0 {
            self.remaining -= 1;
            if self.remaining == 0 {
                self.state = LeaseState::Consumed;
            }
        }
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    #[test]
    fn transitions() {
        let t0 = Instant::now();
        let mut l = Lease::new(LeasePolicy::DeleteOnConsume { consumers: 2 }, t0);
        assert_eq!(l.consume(t0), LeaseState::Live);
        assert_eq!(l.consume(t0), LeaseState::Consumed);
        assert!(l.check(t0, "x").is_err());
        let mut l = Lease::new(LeasePolicy::Ttl(Duration::from_secs(1)), t0);
        assert_eq!(l.state(t0 + Duration::from_millis(999)), LeaseState::Live);
        assert_eq!(l.state(t0 + Duration::from_secs(1)), LeaseState::Expired);
        assert_eq!(l.consume(t0 + Duration::from_secs(2)), LeaseState::Expired);
        let mut l = Lease::new(LeasePolicy::Pinned, t0);
        assert_eq!(l.consume(t0 + Duration::from_secs(9999)), LeaseState::Live);
    }

    proptest! {
        /// A lease never comes back to life, DeleteOnConsume{n} is consumed exactly at the n-th
        /// consume, and Ttl leases never end before their time.
        #[test]
        fn monotone(n in 1u32..5, ttl in 1u64..1000, steps in proptest::collection::vec((any::<bool>(), 0u64..200), 0..40)) {
            let t0 = Instant::now();
            for policy in [LeasePolicy::DeleteOnConsume { consumers: n }, LeasePolicy::Ttl(Duration::from_millis(ttl))] {
                let mut l = Lease::new(policy, t0);
                let (mut now, mut consumed, mut ended) = (t0, 0u32, false);
                for &(consume, dt) in &steps {
                    now += Duration::from_millis(dt);
                    let s = if consume { consumed += 1; l.consume(now) } else { l.state(now) };
                    if ended { prop_assert!(s != LeaseState::Live, "revived"); }
                    if s != LeaseState::Live { ended = true; }
                    match policy {
                        LeasePolicy::DeleteOnConsume { .. } => prop_assert_eq!(s == LeaseState::Consumed, consumed >= n),
                        _ => prop_assert_eq!(s == LeaseState::Expired, now >= t0 + Duration::from_millis(ttl)),
                    }
                }
            }
        }
    }
}
