//! The store's bookkeeping, sans-IO: objects, placement, pins, readers, LRU, watermarks, pending
//! puts and read leases with deadlines (time is passed in). Eviction calls back into the caller
//! to move a victim's bytes to the spill tier before its block is reused.
//!
//! Invariants (property-tested): an object with pins, readers or `Pinned` retention is never
//! evicted; a block is freed exactly once, after its last reader; `Soft` objects go only when no
//! `Normal` object is left to evict.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use tensorwire_core::{Error, Result, TensorMeta};

use crate::alloc::Allocator;
use crate::api::{Retention, StoreStats, missing, show_key};

/// Where an object's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loc {
    /// In the pool at `off` (block of `block` bytes).
    Pool { off: u64, block: u64 },
    /// In the spill tier (file named by the object id).
    Spilled,
}

#[derive(Debug, Clone)]
pub(crate) struct Obj {
    pub(crate) id: u64,
    pub(crate) meta: TensorMeta,
    pub(crate) len: u64,
    pub(crate) retention: Retention,
    pins: u32,
    readers: u32,
    tick: u64,
    pub(crate) loc: Loc,
    /// Consumers still expected (0: not counted).
    consumers: u32,
    /// Removed at this time, if set.
    expires: Option<Instant>,
}

impl Obj {
    fn evictable(&self) -> bool {
        self.pins == 0
            && self.readers == 0
            && self.retention != Retention::Pinned
            && matches!(self.loc, Loc::Pool { .. })
    }
    fn class(&self) -> u8 {
        u8::from(self.retention == Retention::Soft)
    }
}

#[derive(Debug)]
struct Pending {
    key: Vec<u8>,
    id: u64,
    off: u64,
    block: u64,
    len: u64,
    meta: TensorMeta,
    retention: Retention,
    deadline: Instant,
}

#[derive(Debug)]
struct Reading {
    key: Vec<u8>,
    id: u64,
    deadline: Instant,
}

/// What the evictor is asked to do with a victim.
#[derive(Debug)]
pub(crate) struct Victim<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) obj: &'a Obj,
    pub(crate) off: u64,
}

/// A reservation for a put.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reserved {
    pub(crate) ticket: u64,
    pub(crate) off: u64,
}

/// An open read.
#[derive(Debug, Clone)]
pub(crate) struct Opened {
    pub(crate) ticket: u64,
    pub(crate) id: u64,
    pub(crate) meta: TensorMeta,
    pub(crate) len: u64,
    pub(crate) loc: Loc,
}

/// Watermarks as fractions of capacity.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Marks {
    pub(crate) high: u64,
    pub(crate) low: u64,
}

#[derive(Debug)]
pub(crate) struct PoolState {
    alloc: Allocator,
    objs: HashMap<Vec<u8>, Obj>,
    lru: BTreeMap<(u8, u64), Vec<u8>>,
    pending: HashMap<u64, Pending>,
    reading: HashMap<u64, Reading>,
    /// Blocks of removed objects still being read: id -> (off, block, readers).
    doomed: HashMap<u64, (u64, u64, u32)>,
    marks: Marks,
    tick: u64,
    next: u64,
    evictions: u64,
}

/// The evictor: given a victim, spills it (returns true) or lets it be dropped (false).
pub(crate) type Evictor<'e> = dyn FnMut(&Victim<'_>) -> Result<bool> + 'e;

impl PoolState {
    pub(crate) fn new(capacity: u64, marks: Marks) -> Self {
        PoolState {
            alloc: Allocator::new(capacity),
            objs: HashMap::new(),
            lru: BTreeMap::new(),
            pending: HashMap::new(),
            reading: HashMap::new(),
            doomed: HashMap::new(),
            marks,
            tick: 0,
            next: 1,
            evictions: 0,
        }
    }

    fn next_id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn touch(&mut self, key: &[u8]) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(o) = self.objs.get_mut(key) {
            self.lru.remove(&(o.class(), o.tick));
            o.tick = tick;
            if o.evictable() {
                self.lru.insert((o.class(), tick), key.to_vec());
            }
        }
    }

    fn unlist(&mut self, key: &[u8]) {
        if let Some(o) = self.objs.get(key) {
            self.lru.remove(&(o.class(), o.tick));
        }
    }

    fn relist(&mut self, key: &[u8]) {
        if let Some(o) = self.objs.get(key) {
            if o.evictable() {
                self.lru.insert((o.class(), o.tick), key.to_vec());
            }
        }
    }

    /// Evicts the least recently used evictable object; false if there is none.
    fn evict_one(&mut self, evict: &mut Evictor<'_>) -> Result<bool> {
        let Some((&slot, _)) = self.lru.iter().next() else { return Ok(false) };
        let key = self.lru.remove(&slot).unwrap_or_default();
        let Some(obj) = self.objs.get(&key) else { return Ok(true) };
        let Loc::Pool { off, block } = obj.loc else { return Ok(true) };
        let spilled = evict(&Victim { key: &key, obj, off })?;
        self.alloc.free(off, block);
        self.evictions += 1;
        if spilled {
            if let Some(o) = self.objs.get_mut(&key) {
                o.loc = Loc::Spilled;
            }
        } else {
            self.objs.remove(&key);
        }
        Ok(true)
    }

    /// A block for `len` bytes, evicting as needed.
    fn place(&mut self, len: u64, evict: &mut Evictor<'_>) -> Result<(u64, u64)> {
        loop {
            if let Some(b) = self.alloc.alloc(len) {
                return Ok(b);
            }
            if !self.evict_one(evict)? {
                return Err(Error::Capacity {
                    what: format!(
                        "store pool (largest free block {}, nothing evictable)",
                        self.alloc.largest_free()
                    ),
                    requested: len,
                    limit: self.alloc.capacity(),
                });
            }
        }
    }

    /// Evicts down to the low watermark once above the high one.
    fn rebalance(&mut self, evict: &mut Evictor<'_>) -> Result<()> {
        if self.alloc.used() > self.marks.high {
            while self.alloc.used() > self.marks.low && self.evict_one(evict)? {}
        }
        Ok(())
    }

    /// Reserves a block for a put of `key`.
    pub(crate) fn reserve(
        &mut self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        retention: Retention,
        deadline: Instant,
        evict: &mut Evictor<'_>,
    ) -> Result<Reserved> {
        if self.objs.contains_key(key) || self.pending.values().any(|p| p.key == key) {
            return Err(Error::InvalidArgument(format!(
                "store key {} already exists (remove it first)",
                show_key(key)
            )));
        }
        if len > self.alloc.capacity() {
            return Err(Error::Capacity {
                what: "store object larger than the pool".into(),
                requested: len,
                limit: self.alloc.capacity(),
            });
        }
        let (off, block) = self.place(len, evict)?;
        let (ticket, id) = (self.next_id(), self.next_id());
        self.pending.insert(
            ticket,
            Pending {
                key: key.to_vec(),
                id,
                off,
                block,
                len,
                meta: meta.clone(),
                retention,
                deadline,
            },
        );
        Ok(Reserved { ticket, off })
    }

    /// Publishes a reserved put.
    pub(crate) fn commit(&mut self, ticket: u64, evict: &mut Evictor<'_>) -> Result<()> {
        let p = self.pending.remove(&ticket).ok_or_else(|| {
            Error::NotFound(tensorwire_core::Missing::Other(format!(
                "store put {ticket} (expired or already finished)"
            )))
        })?;
        self.tick += 1;
        let obj = Obj {
            id: p.id,
            meta: p.meta,
            len: p.len,
            retention: p.retention,
            pins: 0,
            readers: 0,
            tick: self.tick,
            loc: Loc::Pool { off: p.off, block: p.block },
            consumers: 0,
            expires: None,
        };
        self.objs.insert(p.key.clone(), obj);
        self.relist(&p.key);
        self.rebalance(evict)
    }

    /// Drops a reserved put.
    pub(crate) fn abort(&mut self, ticket: u64) {
        if let Some(p) = self.pending.remove(&ticket) {
            self.alloc.free(p.off, p.block);
        }
    }

    /// Opens a read of `key`: the object cannot be evicted (or its block reused) until closed.
    pub(crate) fn open_read(&mut self, key: &[u8], deadline: Instant) -> Result<Opened> {
        let ticket = self.next_id();
        let o = self.objs.get(key).ok_or_else(|| missing(key))?;
        let opened = Opened { ticket, id: o.id, meta: o.meta.clone(), len: o.len, loc: o.loc };
        self.unlist(key);
        if let Some(o) = self.objs.get_mut(key) {
            o.readers += 1;
        }
        self.touch(key);
        self.reading.insert(ticket, Reading { key: key.to_vec(), id: opened.id, deadline });
        Ok(opened)
    }

    /// Closes a read.
    pub(crate) fn close_read(&mut self, ticket: u64) {
        let Some(r) = self.reading.remove(&ticket) else { return };
        match self.objs.get_mut(&r.key) {
            Some(o) if o.id == r.id => {
                o.readers -= 1;
                self.relist(&r.key);
            }
            _ => {
                if let Some(d) = self.doomed.get_mut(&r.id) {
                    d.2 -= 1;
                    if d.2 == 0 {
                        let (off, block, _) = *d;
                        self.doomed.remove(&r.id);
                        self.alloc.free(off, block);
                    }
                }
            }
        }
    }

    /// Puts a spilled object back in the pool at a new block (its bytes must then be loaded by the
    /// caller before the read that asked for it proceeds; the object has a reader, so it stays).
    pub(crate) fn reload(&mut self, key: &[u8], evict: &mut Evictor<'_>) -> Result<u64> {
        let len = match self.objs.get(key).map(|o| (o.loc, o.len)) {
            None => return Err(missing(key)),
            Some((Loc::Pool { off, .. }, _)) => return Ok(off),
            Some((Loc::Spilled, len)) => len,
        };
        let (off, block) = self.place(len, evict)?;
        if let Some(o) = self.objs.get_mut(key) {
            o.loc = Loc::Pool { off, block };
        }
        Ok(off)
    }

    /// Undoes a `reload` whose bytes could not be loaded: the object stays in the spill tier.
    pub(crate) fn unload(&mut self, key: &[u8]) {
        if let Some(o) = self.objs.get_mut(key) {
            if let Loc::Pool { off, block } = o.loc {
                o.loc = Loc::Spilled;
                self.alloc.free(off, block);
            }
        }
    }

    /// Removes `key`; returns the removed object (its block is freed now, or after its readers).
    pub(crate) fn remove(&mut self, key: &[u8]) -> Option<Obj> {
        self.unlist(key);
        let o = self.objs.remove(key)?;
        if let Loc::Pool { off, block } = o.loc {
            if o.readers == 0 {
                self.alloc.free(off, block);
            } else {
                self.doomed.insert(o.id, (off, block, o.readers));
            }
        }
        Some(o)
    }

    pub(crate) fn exists(&self, key: &[u8]) -> bool {
        self.objs.contains_key(key)
    }

    pub(crate) fn pin(&mut self, key: &[u8], up: bool) -> Result<()> {
        self.unlist(key);
        let o = self.objs.get_mut(key).ok_or_else(|| missing(key))?;
        if up {
            o.pins += 1;
        } else if o.pins == 0 {
            let e = Error::InvalidArgument(format!("store key {} is not pinned", show_key(key)));
            self.relist(key);
            return Err(e);
        } else {
            o.pins -= 1;
        }
        self.relist(key);
        Ok(())
    }

    /// Sets an object's lease: the number of consumers that will call `consumed` (0: not
    /// counted) and a time after which it is removed.
    pub(crate) fn set_lease(
        &mut self,
        key: &[u8],
        consumers: u32,
        expires: Option<Instant>,
    ) -> Result<()> {
        let o = self.objs.get_mut(key).ok_or_else(|| missing(key))?;
        o.consumers = consumers;
        o.expires = expires;
        Ok(())
    }

    /// One consumer is done; returns the removed object when it was the last.
    pub(crate) fn consumed(&mut self, key: &[u8]) -> Result<Option<Obj>> {
        let o = self.objs.get_mut(key).ok_or_else(|| missing(key))?;
        if o.consumers == 0 {
            return Err(Error::InvalidArgument(format!(
                "store key {} has no consumer count (set a lease first)",
                show_key(key)
            )));
        }
        o.consumers -= 1;
        if o.consumers == 0 { Ok(self.remove(key)) } else { Ok(None) }
    }

    /// Removes objects whose lease time has passed; returns them (their spill files must go).
    pub(crate) fn expire_objects(&mut self, now: Instant) -> Vec<Obj> {
        let dead: Vec<Vec<u8>> = self
            .objs
            .iter()
            .filter(|(_, o)| o.expires.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        dead.iter().filter_map(|k| self.remove(k)).collect()
    }

    /// Aborts pending puts and closes read leases past their deadline.
    pub(crate) fn expire(&mut self, now: Instant) {
        let dead: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(&t, _)| t).collect();
        for t in dead {
            self.abort(t);
        }
        let dead: Vec<u64> =
            self.reading.iter().filter(|(_, r)| r.deadline <= now).map(|(&t, _)| t).collect();
        for t in dead {
            self.close_read(t);
        }
    }

    pub(crate) fn stats(&self) -> StoreStats {
        StoreStats {
            capacity: self.alloc.capacity(),
            used: self.alloc.used(),
            objects: self.objs.values().filter(|o| matches!(o.loc, Loc::Pool { .. })).count()
                as u64,
            spilled_objects: self.objs.values().filter(|o| o.loc == Loc::Spilled).count() as u64,
            evictions: self.evictions,
            largest_free: self.alloc.largest_free(),
        }
    }

    /// The id of `key` if it is in the spill tier.
    pub(crate) fn spilled_id(&self, key: &[u8]) -> Option<u64> {
        self.objs.get(key).filter(|o| o.loc == Loc::Spilled).map(|o| o.id)
    }

    /// Keys and ids of every object (for shutdown cleanup of the spill tier).
    pub(crate) fn spilled_ids(&self) -> Vec<u64> {
        self.objs.values().filter(|o| o.loc == Loc::Spilled).map(|o| o.id).collect()
    }
}

/// A deadline `ttl` from now.
pub(crate) fn deadline(ttl: Duration) -> Instant {
    Instant::now() + ttl
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tensorwire_core::DType;

    fn meta(n: u64) -> TensorMeta {
        TensorMeta::contiguous(DType::U8, &[n])
    }

    fn put(
        s: &mut PoolState,
        key: &str,
        len: u64,
        r: Retention,
        ev: &mut Evictor<'_>,
    ) -> Result<()> {
        let far = Instant::now() + Duration::from_secs(3600);
        let t = s.reserve(key.as_bytes(), &meta(len), len, r, far, ev)?;
        s.commit(t.ticket, ev)
    }

    #[test]
    fn lru_order_soft_last_pinned_never() {
        let marks = Marks { high: 40 * 4096, low: 30 * 4096 };
        let mut s = PoolState::new(40 * 4096, marks);
        let log = std::cell::RefCell::new(Vec::<String>::new());
        let mut ev = |v: &Victim<'_>| {
            log.borrow_mut().push(String::from_utf8(v.key.to_vec()).unwrap());
            Ok(false)
        };
        let evicted = || log.borrow().clone();
        put(&mut s, "soft", 10 * 4096, Retention::Soft, &mut ev).unwrap();
        put(&mut s, "pinned", 10 * 4096, Retention::Pinned, &mut ev).unwrap();
        put(&mut s, "a", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        put(&mut s, "b", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        let far = Instant::now() + Duration::from_secs(3600);
        let r = s.open_read(b"a", far).unwrap(); // a is being read: not evictable
        put(&mut s, "c", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        assert_eq!(evicted(), ["b"]);
        put(&mut s, "d", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        assert_eq!(evicted(), ["b", "c"]);
        s.close_read(r.ticket);
        put(&mut s, "e", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        assert_eq!(evicted(), ["b", "c", "a"]);
        put(&mut s, "f", 20 * 4096, Retention::Normal, &mut ev).unwrap();
        assert_eq!(evicted(), ["b", "c", "a", "d", "e"]);
        put(&mut s, "g", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        assert_eq!(evicted(), ["b", "c", "a", "d", "e", "f"]);
        put(&mut s, "h", 10 * 4096, Retention::Normal, &mut ev).unwrap(); // fits in f's old block
        s.pin(b"g", true).unwrap();
        s.pin(b"h", true).unwrap();
        put(&mut s, "i", 10 * 4096, Retention::Normal, &mut ev).unwrap();
        assert_eq!(evicted().last().unwrap(), "soft", "soft goes once no normal object is left");
        assert!(s.exists(b"pinned"));
        assert!(matches!(
            put(&mut s, "huge", 41 * 4096, Retention::Normal, &mut ev),
            Err(Error::Capacity { .. })
        ));
    }

    #[test]
    fn expiry_frees_abandoned_puts_and_reads() {
        let mut s = PoolState::new(10 * 4096, Marks { high: 10 * 4096, low: 10 * 4096 });
        let mut ev = |_: &Victim<'_>| Ok(false);
        let now = Instant::now();
        let soon = now + Duration::from_millis(10);
        s.reserve(b"x", &meta(4096), 4096, Retention::Normal, soon, &mut ev).unwrap();
        put(&mut s, "y", 4096, Retention::Normal, &mut ev).unwrap();
        s.open_read(b"y", soon).unwrap();
        s.remove(b"y");
        assert_eq!(s.stats().used, 2 * 4096, "pending put and read-held block");
        s.expire(now + Duration::from_millis(20));
        assert_eq!(s.stats().used, 0);
    }

    proptest! {
        /// Under random puts, reads, pins and removes: pinned, read and `Pinned` objects are never
        /// evicted, and used bytes always equal live blocks.
        #[test]
        fn never_evicts_held_objects(ops in proptest::collection::vec((0u8..6, 0u8..12, 1u64..6), 1..300)) {
            let marks = Marks { high: 48 * 4096, low: 32 * 4096 };
            let mut s = PoolState::new(64 * 4096, marks);
            let far = Instant::now() + Duration::from_secs(3600);
            let mut held: HashMap<String, u32> = HashMap::new();
            let mut reads: Vec<(String, u64)> = Vec::new();
            for (op, k, n) in ops {
                let key = format!("k{k}");
                let protected: Vec<String> = held.iter().filter(|(_, c)| **c > 0).map(|(k, _)| k.clone())
                    .chain(reads.iter().map(|(k, _)| k.clone())).collect();
                let mut bad = None;
                let mut ev = |v: &Victim<'_>| {
                    let k = String::from_utf8(v.key.to_vec()).unwrap();
                    if protected.contains(&k) || v.obj.retention == Retention::Pinned { bad = Some(k); }
                    Ok(false)
                };
                match op {
                    0 | 1 => {
                        let r = if n == 5 { Retention::Pinned } else { Retention::Normal };
                        let _ = put(&mut s, &key, n * 4096, r, &mut ev);
                    }
                    2 => if let Ok(o) = s.open_read(key.as_bytes(), far) { reads.push((key, o.ticket)); },
                    3 => if let Some((_, t)) = reads.pop() { s.close_read(t); },
                    4 => if s.pin(key.as_bytes(), true).is_ok() { *held.entry(key).or_default() += 1; },
                    _ => {
                        if s.pin(key.as_bytes(), false).is_ok() { *held.entry(key.clone()).or_default() -= 1; }
                        else if !reads.iter().any(|(k, _)| *k == key) && held.get(&key).copied().unwrap_or(0) == 0 {
                            s.remove(key.as_bytes());
                        }
                    }
                }
                prop_assert_eq!(bad, None);
            }
            for (_, t) in reads { s.close_read(t); }
            let keys: Vec<Vec<u8>> = s.objs.keys().cloned().collect();
            for k in keys { s.remove(&k); }
            prop_assert_eq!(s.stats().used, 0);
        }
    }
}
