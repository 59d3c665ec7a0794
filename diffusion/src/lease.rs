//! A lease's state machine: plain data, time passed in. The connector keeps one per p2p payload;
//! the store keeps the same rules for store-relayed payloads.

use std::time::Instant;

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
        Lease::start(policy, now)
    }

    /// [`Lease::new`]'s body, in a function of another name: mutation testing (cargo-mutants)
    /// does not look inside functions named `new`, and this one sets the consumer count.
    fn start(policy: LeasePolicy, now: Instant) -> Lease {
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
