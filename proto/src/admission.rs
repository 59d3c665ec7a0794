//! What a peer that has not proved itself yet may hold on a listener: every listener (the
//! engine's control endpoint, the tcp data listener, the store node, the orchestrator service,
//! the rdma and nccl control channels, the metrics endpoint) admits each accepted connection as
//! *pending* until it has proved itself (a handshake, a data ticket, a request head), and pending
//! connections are bounded three ways:
//!
//! - in time: a pending connection that has not proved itself by its deadline is closed;
//! - in number per source address: a new connection from a source that already holds
//!   `per_source` pending ones closes the oldest of them;
//! - in number per listener: a new connection when `pending` are held closes the oldest.
//!
//! A new connection is always admitted and the *oldest* goes: an attacker who holds the cap
//! with idle connections loses them to the next newcomer, and a legitimate peer (which proves
//! itself within milliseconds) gets through unless someone opens more than the cap within that
//! time. The bookkeeping is a plain struct ([`Ledger`], no IO, no clock); [`Admission`] is the
//! tokio glue that closes an evicted connection by ending the future that serves it.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::Error;

/// The bounds on a listener's pending connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Pending connections per listener.
    pub pending: usize,
    /// Pending connections per source address.
    pub per_source: usize,
    /// How long a connection may stay pending.
    pub deadline: Duration,
}

impl Limits {
    /// The bounds of the listeners that open with a handshake: 256 pending, 64 per source, and
    /// `deadline` to prove itself. 256 sockets are a quarter of a common 1,024-descriptor limit,
    /// and more handshakes at once than that are not seen in a cluster's normal life.
    pub fn handshake(deadline: Duration) -> Limits {
        Limits { pending: 256, per_source: 64, deadline }
    }
}

/// The sans-IO bookkeeping of pending connections: ids in arrival order, counts per source.
#[derive(Debug, Default)]
pub struct Ledger {
    next: u64,
    order: BTreeMap<u64, IpAddr>,
    per_source: HashMap<IpAddr, usize>,
    evicted: u64,
}

impl Ledger {
    /// Admits a connection from `source` under `limits`: its id and, when a bound was reached,
    /// the id of the connection that must be closed to make room (the oldest of the same source
    /// when its source is at `per_source`, else the oldest of all).
    pub fn admit(&mut self, source: IpAddr, limits: &Limits) -> (u64, Option<u64>) {
        let from_source = self.per_source.get(&source).copied().unwrap_or(0);
        let victim = if from_source >= limits.per_source.max(1) {
            self.order.iter().find(|(_, s)| **s == source).map(|(id, _)| *id)
        } else if self.order.len() >= limits.pending.max(1) {
            self.order.keys().next().copied()
        } else {
            None
        };
        if let Some(v) = victim {
            self.remove(v);
            self.evicted += 1;
        }
        let id = self.next;
        self.next += 1;
        self.order.insert(id, source);
        *self.per_source.entry(source).or_default() += 1;
        (id, victim)
    }

    /// Forgets connection `id` (it proved itself, ended, or was evicted); false when it was not
    /// held.
    pub fn remove(&mut self, id: u64) -> bool {
        let Some(source) = self.order.remove(&id) else { return false };
        if let Some(n) = self.per_source.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&source);
            }
        }
        true
    }

    /// Pending connections held now.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether none is pending.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Pending connections of `source` held now.
    pub fn of(&self, source: IpAddr) -> usize {
        self.per_source.get(&source).copied().unwrap_or(0)
    }

    /// Connections evicted so far to make room.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[derive(Debug, Default)]
struct Shared {
    ledger: Ledger,
    /// What wakes each pending connection's future when it is evicted.
    wake: HashMap<u64, Arc<Notify>>,
}

/// One listener's admission (cheap to clone; every clone is the same ledger).
#[derive(Debug, Clone)]
pub struct Admission {
    name: &'static str,
    limits: Limits,
    shared: Arc<Mutex<Shared>>,
}

/// Why a pending connection was closed before it proved itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// It did not prove itself within the deadline.
    Deadline,
    /// A newer connection took its place.
    Evicted,
}

impl Admission {
    /// An admission for the listener named `name` (in log lines) under `limits`.
    pub fn new(name: &'static str, limits: Limits) -> Admission {
        Admission { name, limits, shared: Arc::default() }
    }

    /// The bounds.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a connection from `source`, closing the oldest pending one when a bound is
    /// reached. The connection stays pending until [`Pending::proved`] or the guard drops.
    pub fn admit(&self, source: IpAddr) -> Pending {
        let wake = Arc::new(Notify::new());
        let mut s = self.lock();
        let (id, victim) = s.ledger.admit(source, &self.limits);
        if let Some(v) = victim {
            if let Some(w) = s.wake.remove(&v) {
                w.notify_one();
            }
            tracing::debug!(listener = self.name, %source, "a pending connection was closed to make room");
        }
        s.wake.insert(id, wake.clone());
        Pending { admission: self.clone(), id, wake, held: true }
    }

    /// Pending connections held now, and of `source`.
    pub fn pending(&self, source: Option<IpAddr>) -> usize {
        let s = self.lock();
        source.map_or(s.ledger.len(), |ip| s.ledger.of(ip))
    }

    /// Connections closed so far to make room for newer ones.
    pub fn evicted(&self) -> u64 {
        self.lock().ledger.evicted()
    }

    fn forget(&self, id: u64) {
        let mut s = self.lock();
        s.ledger.remove(id);
        s.wake.remove(&id);
    }
}

/// A pending connection's place; dropping it gives the place back.
#[derive(Debug)]
pub struct Pending {
    admission: Admission,
    id: u64,
    wake: Arc<Notify>,
    held: bool,
}

impl Pending {
    /// Runs `fut` (the connection's proof: its handshake, its ticket) until it ends, the
    /// deadline passes or a newer connection evicts this one.
    pub async fn prove<F: Future>(&mut self, fut: F) -> Result<F::Output, Closed> {
        if !self.held {
            return Ok(fut.await);
        }
        let deadline = self.admission.limits.deadline;
        tokio::select! {
            out = fut => Ok(out),
            _ = tokio::time::sleep(deadline) => Err(Closed::Deadline),
            _ = self.wake.notified() => Err(Closed::Evicted),
        }
    }

    /// How long the connection may stay pending.
    pub fn deadline(&self) -> Duration {
        self.admission.limits.deadline
    }

    /// The connection proved itself: it is no longer pending (nor bounded by this admission).
    pub fn proved(&mut self) {
        if std::mem::take(&mut self.held) {
            self.admission.forget(self.id);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.proved();
    }
}

impl Closed {
    /// The error of a connection closed so, for logs (`what`: the listener).
    pub fn error(self, what: &str, limit: Duration) -> Error {
        match self {
            Closed::Deadline => Error::timeout(format!("{what}: a peer proving itself"), limit),
            Closed::Evicted => {
                Error::PeerClosed(format!("{what}: closed to make room for newer connections"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    const L: Limits = Limits { pending: 4, per_source: 2, deadline: Duration::from_secs(1) };

    #[test]
    fn the_oldest_of_a_full_source_goes_first_then_the_oldest_of_all() {
        let mut l = Ledger::default();
        assert!(l.is_empty());
        assert_eq!(l.admit(ip(1), &L), (0, None));
        assert!(!l.is_empty());
        assert_eq!(l.admit(ip(1), &L), (1, None));
        // Source 1 is at its bound: its oldest goes, not anybody else's.
        assert_eq!(l.admit(ip(2), &L), (2, None));
        assert_eq!(l.admit(ip(1), &L), (3, Some(0)));
        assert_eq!((l.len(), l.of(ip(1)), l.of(ip(2))), (3, 2, 1));
        assert_eq!(l.admit(ip(3), &L), (4, None));
        // The listener is at its bound: the oldest of all goes (2, of source 2).
        assert_eq!(l.admit(ip(4), &L), (5, Some(1)));
        assert_eq!(l.admit(ip(5), &L), (6, Some(2)));
        assert_eq!(l.of(ip(2)), 0);
        assert_eq!(l.evicted(), 3);
        assert!(l.remove(6) && !l.remove(6));
        assert_eq!(l.len(), 3);
    }

    #[test]
    fn zero_limits_still_admit_one() {
        let z = Limits { pending: 0, per_source: 0, deadline: Duration::ZERO };
        let mut l = Ledger::default();
        assert_eq!(l.admit(ip(1), &z), (0, None));
        assert_eq!(l.admit(ip(1), &z), (1, Some(0)));
        assert_eq!(l.len(), 1);
    }

    proptest! {
        #[test]
        fn bounds_hold_under_any_sequence(ops in proptest::collection::vec((0u8..6, any::<bool>()), 0..200)) {
            let mut l = Ledger::default();
            let mut live: Vec<u64> = Vec::new();
            for (src, admit) in ops {
                if admit || live.is_empty() {
                    let (id, victim) = l.admit(ip(src), &L);
                    if let Some(v) = victim {
                        prop_assert!(v < id);
                        live.retain(|x| *x != v);
                    }
                    live.push(id);
                } else {
                    let id = live.remove(usize::from(src) % live.len());
                    prop_assert!(l.remove(id));
                }
                prop_assert!(l.len() <= L.pending && l.len() == live.len());
                for s in 0..6 {
                    prop_assert!(l.of(ip(s)) <= L.per_source);
                }
            }
        }
    }

    #[tokio::test]
    async fn an_evicted_or_late_connection_is_closed_and_a_proved_one_keeps_going() {
        let a = Admission::new(
            "test",
            Limits { pending: 1, per_source: 1, deadline: Duration::from_secs(30) },
        );
        assert_eq!(a.evicted(), 0);
        let mut first = a.admit(ip(1));
        let mut second = a.admit(ip(1)); // evicts the first
        let r = first.prove(std::future::pending::<()>()).await;
        assert_eq!(r, Err(Closed::Evicted));
        assert_eq!(second.prove(async { 7 }).await, Ok(7));
        second.proved();
        assert_eq!(a.pending(None), 0);
        // Proved, it is bounded by nothing of the admission any more.
        let _third = a.admit(ip(1));
        assert_eq!(second.prove(async { 8 }).await, Ok(8));
        drop(first);
        assert_eq!(a.pending(Some(ip(1))), 1);

        let quick = Admission::new(
            "test",
            Limits { pending: 4, per_source: 4, deadline: Duration::from_millis(20) },
        );
        let mut p = quick.admit(ip(2));
        assert_eq!(p.deadline(), Duration::from_millis(20));
        assert_eq!(p.prove(std::future::pending::<()>()).await, Err(Closed::Deadline));
        drop(p);
        assert_eq!(quick.pending(None), 0);
        assert_eq!((a.evicted(), quick.evicted()), (1, 0));
        let _fourth = a.admit(ip(1)); // evicts the third
        assert_eq!(a.evicted(), 2);
    }
}
