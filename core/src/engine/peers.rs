//! The descriptors of peers that shook hands with this engine (either direction), kept so that
//! [`crate::Engine::session`] can reach a peer that connected to us. Bounded: at most
//! `max_peers` descriptors and `max_bytes` of them, the least recently used going first, and
//! a peer's descriptor goes with its session ([`crate::Session::close`]). A peer dropped from the
//! table is not cut off: its sessions keep their own copy, and its next handshake puts it back.
//! Sans-IO: a plain struct, no clock (recency is a counter).

use std::collections::{BTreeMap, HashMap};

use crate::ids::EngineId;
use crate::wire::descriptor::EngineDescriptor;

/// What one descriptor costs the table: its encoded bytes plus the decoded form's fixed part
/// per region (the bytes of a decoded descriptor are about its encoded size plus that).
pub(crate) fn cost(desc: &EngineDescriptor, encoded: usize) -> usize {
    encoded
        + std::mem::size_of::<EngineDescriptor>()
        + desc.regions.len() * std::mem::size_of::<crate::region::RemoteRegion>()
}

#[derive(Debug)]
struct Entry {
    desc: EngineDescriptor,
    cost: usize,
    used: u64,
}

/// The bounded table.
#[derive(Debug)]
pub(crate) struct PeerTable {
    max_peers: usize,
    max_bytes: usize,
    entries: HashMap<EngineId, Entry>,
    /// Recency -> peer: the first is the least recently used.
    by_use: BTreeMap<u64, EngineId>,
    bytes: usize,
    clock: u64,
}

impl PeerTable {
    pub(crate) fn new(max_peers: usize, max_bytes: usize) -> PeerTable {
        PeerTable {
            max_peers: max_peers.max(1),
            max_bytes,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            bytes: 0,
            clock: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Keeps `desc` (replacing the peer's older one), then drops the least recently used until
    /// the table is within its bounds again. A descriptor too large for the byte bound alone
    /// is not kept.
    pub(crate) fn insert(&mut self, desc: EngineDescriptor, encoded: usize) {
        let id = desc.engine;
        self.remove(id);
        let cost = cost(&desc, encoded);
        if cost > self.max_bytes {
            return;
        }
        let used = self.tick();
        self.by_use.insert(used, id);
        self.entries.insert(id, Entry { desc, cost, used });
        self.bytes += cost;
        while self.entries.len() > self.max_peers || self.bytes > self.max_bytes {
            let Some((_, oldest)) = self.by_use.pop_first() else { break };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.cost;
            }
        }
    }

    /// The peer's descriptor (now the most recently used).
    pub(crate) fn get(&mut self, id: EngineId) -> Option<EngineDescriptor> {
        let now = self.tick();
        let e = self.entries.get_mut(&id)?;
        self.by_use.remove(&e.used);
        e.used = now;
        self.by_use.insert(now, id);
        Some(e.desc.clone())
    }

    /// Forgets the peer.
    pub(crate) fn remove(&mut self, id: EngineId) {
        if let Some(e) = self.entries.remove(&id) {
            self.by_use.remove(&e.used);
            self.bytes -= e.cost;
        }
    }

    /// Descriptors kept, and what they cost.
    pub(crate) fn usage(&self) -> (usize, usize) {
        (self.entries.len(), self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn desc(id: u128) -> EngineDescriptor {
        EngineDescriptor {
            engine: EngineId(id),
            host: "h".into(),
            backends: vec![],
            regions: vec![],
        }
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let unit = cost(&desc(0), 100);
        let mut t = PeerTable::new(3, usize::MAX);
        for id in 1..=3 {
            t.insert(desc(id), 100);
        }
        assert!(t.get(EngineId(1)).is_some()); // 1 is now the most recent
        t.insert(desc(4), 100);
        assert!(t.get(EngineId(2)).is_none(), "2 was the least recently used");
        assert!(t.get(EngineId(1)).is_some() && t.get(EngineId(3)).is_some());
        assert_eq!(t.usage(), (3, 3 * unit));
        // A re-handshake replaces, it does not add.
        t.insert(desc(3), 100);
        assert_eq!(t.usage(), (3, 3 * unit));
        t.remove(EngineId(3));
        t.remove(EngineId(3));
        assert_eq!(t.usage(), (2, 2 * unit));
    }

    #[test]
    fn bytes_are_bounded_too_and_a_descriptor_over_the_bound_is_not_kept() {
        let unit = cost(&desc(0), 1000);
        let mut t = PeerTable::new(100, 2 * unit);
        for id in 1..=5 {
            t.insert(desc(id), 1000);
        }
        assert_eq!(t.usage(), (2, 2 * unit));
        assert!(t.get(EngineId(5)).is_some() && t.get(EngineId(4)).is_some());
        t.insert(desc(9), 10 * unit);
        assert!(t.get(EngineId(9)).is_none());
        assert_eq!(t.usage(), (2, 2 * unit));
    }

    proptest! {
        #[test]
        fn bounds_hold_and_the_count_adds_up(ops in proptest::collection::vec((0u128..20, 0usize..5000, 0u8..3), 0..300)) {
            let mut t = PeerTable::new(8, 20_000);
            for (id, size, op) in ops {
                match op {
                    0 => t.insert(desc(id), size),
                    1 => { t.get(EngineId(id)); }
                    _ => t.remove(EngineId(id)),
                }
                let (n, bytes) = t.usage();
                prop_assert!(n <= 8 && bytes <= 20_000);
                prop_assert_eq!(bytes, t.entries.values().map(|e| e.cost).sum::<usize>());
                prop_assert_eq!(t.by_use.len(), n);
            }
        }
    }
}
