//! The store's bookkeeping, sans-IO: objects, placement, pins, readers, LRU, watermarks, pending
//! puts and read leases with deadlines (time is passed in). It never touches a byte or a file:
//! what must happen to them comes out as [`Io`] (spill a victim's block to its file, delete a
//! file), which the embedded store carries out after releasing the pool lock and reports back
//! ([`PoolState::spilled`], [`PoolState::loaded`]).
//!
//! Pool blocks and spill files are held resources: a block (or file) belongs to its object and is
//! also held by every open read and by an in-flight spill or load of it; it is freed (deleted)
//! once its object let go of it and nothing holds it. So a victim's block is reused only after its
//! bytes reached the file, and a removed object's bytes stay readable by reads already open.
//!
//! Invariants (property-tested): an object with pins, open reads, `Pinned` retention or an IO in
//! flight is never evicted; a block is freed exactly once, after its last holder; `Soft` objects
//! go only when no `Normal` object is left to evict; used bytes equal live blocks.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use tensorwire_core::TensorMeta;

use crate::alloc::Allocator;
use crate::api::{ObjectInfo, Retention, StoreStats};
use crate::error::{Result, StoreError, StoreKey};

/// Where an object's bytes are. Blocks are named by their pool offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loc {
    /// In the pool.
    Pool(u64),
    /// In the pool and being written to the spill tier.
    Spilling(u64),
    /// In the spill tier only.
    Spilled,
    /// In the spill tier and being read back into this block.
    Loading(u64),
}

/// A resource (block or file) with its owner's claim and its other holders.
#[derive(Debug)]
struct Held {
    owned: bool,
    holders: u32,
}

#[derive(Debug)]
struct Block {
    size: u64,
    held: Held,
}

#[derive(Debug, Clone)]
struct Obj {
    id: u64,
    meta: TensorMeta,
    len: u64,
    retention: Retention,
    pins: u32,
    tick: u64,
    loc: Loc,
    /// Consumers still expected (0: not counted).
    consumers: u32,
    /// Consumers that reported before any count was set (a consumer faster than the
    /// producer's `set_lease`); counted against the count when it comes.
    early: u32,
    /// Removed at this time, if set.
    expires: Option<Instant>,
}

impl Obj {
    fn class(&self) -> u8 {
        u8::from(self.retention == Retention::Soft)
    }
}

#[derive(Debug)]
struct Pending {
    key: Vec<u8>,
    id: u64,
    off: u64,
    len: u64,
    meta: TensorMeta,
    retention: Retention,
    deadline: Instant,
}

/// What an open read holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Block(u64),
    File(u64),
}

#[derive(Debug)]
struct Reading {
    hold: Hold,
    deadline: Instant,
    /// The object read (relisted when the read expires: it may be evictable again).
    key: Vec<u8>,
}

/// Work on bytes and files, carried out outside the pool lock.
#[derive(Debug)]
pub(crate) enum Io {
    /// Write the object's block to its spill file, then report with [`PoolState::spilled`].
    Spill(SpillJob),
    /// Delete object `id`'s spill file.
    Delete(u64),
}

/// Most consumption reports an object keeps while it has no consumer count.
pub(crate) const MAX_EARLY: u32 = 1024;

/// A victim to write to the spill tier.
#[derive(Debug, Clone)]
pub(crate) struct SpillJob {
    pub(crate) id: u64,
    pub(crate) key: Vec<u8>,
    pub(crate) meta: TensorMeta,
    pub(crate) len: u64,
    /// The block (offset and size) holding the bytes.
    pub(crate) off: u64,
    pub(crate) size: u64,
    /// The object's lease now (the file keeps it).
    pub(crate) lease: crate::spill::Lease,
}

/// A spilled object to read back into the pool block at `off`; report with
/// [`PoolState::loaded`].
#[derive(Debug, Clone)]
pub(crate) struct LoadJob {
    pub(crate) id: u64,
    pub(crate) key: Vec<u8>,
    pub(crate) len: u64,
    pub(crate) off: u64,
}

/// The outcome of a call that may need IO first.
#[derive(Debug)]
pub(crate) enum Step<T> {
    /// Done.
    Done(T),
    /// Spills are in flight that will make room: carry out the queued IO (or wait for others
    /// to) and call again.
    Wait,
}

/// A reservation for a put.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reserved {
    pub(crate) ticket: u64,
    pub(crate) off: u64,
}

/// Where an open read finds the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// In the pool at this offset.
    Pool(u64),
    /// In spill file `id` (read it straight into the destination).
    File,
}

/// An open read.
#[derive(Debug, Clone)]
pub(crate) struct Opened {
    pub(crate) ticket: u64,
    pub(crate) id: u64,
    pub(crate) meta: TensorMeta,
    pub(crate) len: u64,
    pub(crate) source: Source,
    /// Load the object into the pool first (a read that must find it in the pool).
    pub(crate) load: Option<LoadJob>,
}

/// Watermarks in bytes.
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
    blocks: HashMap<u64, Block>,
    files: HashMap<u64, Held>,
    pending: HashMap<u64, Pending>,
    reading: HashMap<u64, Reading>,
    /// Objects with a lease time, by that time: what `expire` removes, found without a scan of
    /// every object (every lock of the store runs it).
    expiring: BTreeSet<(Instant, Vec<u8>)>,
    io: Vec<Io>,
    /// Bytes of blocks whose spill is in flight (room that is coming).
    spilling: u64,
    /// Evicted objects go to the spill tier (else they are dropped).
    spill: bool,
    marks: Marks,
    tick: u64,
    next: u64,
    evictions: u64,
}

fn exists(key: &[u8]) -> StoreError {
    StoreError::Exists { key: StoreKey(key.to_vec()) }
}

impl PoolState {
    pub(crate) fn new(capacity: u64, marks: Marks, spill: bool) -> Self {
        PoolState {
            alloc: Allocator::new(capacity),
            objs: HashMap::new(),
            lru: BTreeMap::new(),
            blocks: HashMap::new(),
            files: HashMap::new(),
            pending: HashMap::new(),
            reading: HashMap::new(),
            expiring: BTreeSet::new(),
            io: Vec::new(),
            spilling: 0,
            spill,
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

    /// The IO queued since the last call, for the caller to carry out after unlocking.
    pub(crate) fn take_io(&mut self) -> Vec<Io> {
        std::mem::take(&mut self.io)
    }

    // --- held resources ---

    fn new_block(&mut self, len: u64) -> Option<u64> {
        let (off, size) = self.alloc.alloc(len)?;
        self.blocks.insert(off, Block { size, held: Held { owned: true, holders: 0 } });
        Some(off)
    }

    fn held(&mut self, h: Hold) -> Option<&mut Held> {
        match h {
            Hold::Block(off) => self.blocks.get_mut(&off).map(|b| &mut b.held),
            Hold::File(id) => self.files.get_mut(&id),
        }
    }

    fn hold(&mut self, h: Hold) {
        if let Some(held) = self.held(h) {
            held.holders += 1;
        }
    }

    /// Drops one holder (`holder`) or the owner's claim (`!holder`); frees what nobody holds.
    fn release(&mut self, h: Hold, holder: bool) {
        let Some(held) = self.held(h) else { return };
        if holder {
            held.holders = held.holders.saturating_sub(1);
        } else {
            held.owned = false;
        }
        if held.owned || held.holders > 0 {
            return;
        }
        match h {
            Hold::Block(off) => {
                if let Some(b) = self.blocks.remove(&off) {
                    self.alloc.free(off, b.size);
                }
            }
            Hold::File(id) => {
                self.files.remove(&id);
                self.io.push(Io::Delete(id));
            }
        }
    }

    // --- LRU ---

    fn evictable(&self, o: &Obj) -> bool {
        let Loc::Pool(off) = o.loc else { return false };
        o.pins == 0
            && o.retention != Retention::Pinned
            && self.blocks.get(&off).is_some_and(|b| b.held.holders == 0)
    }

    /// Puts `key` in the LRU (at a fresh tick when `touch`) if it is evictable, out of it if not.
    fn relist(&mut self, key: &[u8], touch: bool) {
        let Some(o) = self.objs.get(key) else { return };
        let (slot, fits) = ((o.class(), o.tick), self.evictable(o));
        self.lru.remove(&slot);
        if touch {
            self.tick += 1;
        }
        let tick = self.tick;
        let Some(o) = self.objs.get_mut(key) else { return };
        if touch {
            o.tick = tick;
        }
        if fits {
            self.lru.insert((o.class(), o.tick), key.to_vec());
        }
    }

    /// Evicts the least recently used evictable object: dropped, or its spill started. False if
    /// there is none.
    fn evict_one(&mut self) -> bool {
        let Some((_, key)) = self.lru.pop_first() else { return false };
        let Some(o) = self.objs.get_mut(&key) else { return true };
        let Loc::Pool(off) = o.loc else { return true };
        self.evictions += 1;
        metrics::counter!("tensorwire_store_evictions_total").increment(1);
        if !self.spill {
            let gone = o.expires;
            self.objs.remove(&key);
            self.unlist_expiry(&key, gone);
            self.release(Hold::Block(off), false);
            return true;
        }
        self.start_spill(&key);
        true
    }

    /// Starts writing `key`'s block to its file, if it is in the pool.
    fn start_spill(&mut self, key: &[u8]) {
        let Some(o) = self.objs.get_mut(key) else { return };
        let Loc::Pool(off) = o.loc else { return };
        o.loc = Loc::Spilling(off);
        let job = SpillJob {
            id: o.id,
            key: key.to_vec(),
            meta: o.meta.clone(),
            len: o.len,
            off,
            size: self.blocks.get(&off).map_or(0, |b| b.size),
            lease: crate::spill::Lease::new(o.retention, o.consumers, o.expires),
        };
        self.spilling += job.size;
        self.hold(Hold::Block(off));
        self.io.push(Io::Spill(job));
    }

    /// A clean shutdown: every object still only in the pool is written to its file (pinned
    /// ones first), so that a store opened on the same spill directory finds them all. Needs a
    /// spill tier; returns how many spills were queued.
    pub(crate) fn spill_all(&mut self) -> usize {
        if !self.spill {
            return 0;
        }
        let mut keys: Vec<(bool, Vec<u8>)> = self
            .objs
            .iter()
            .filter(|(_, o)| matches!(o.loc, Loc::Pool(_)))
            .map(|(k, o)| (o.retention != Retention::Pinned, k.clone()))
            .collect();
        keys.sort();
        for (_, k) in &keys {
            self.start_spill(k);
            self.relist(k, false); // out of the LRU while it spills
        }
        keys.len()
    }

    /// An object found in the spill tier at start (a store restarted on its spill directory).
    /// Of two files with the same key (a crash between a re-spill and the old file's
    /// deletion), the newer id wins and the other file is deleted.
    pub(crate) fn recover(&mut self, f: crate::spill::Found) {
        let key = f.header.key;
        if let Some(o) = self.objs.get(&key) {
            let (older, newer) = if o.id < f.id { (o.id, f.id) } else { (f.id, o.id) };
            if newer == f.id {
                self.files.remove(&older);
                let gone = o.expires;
                self.objs.remove(&key);
                self.unlist_expiry(&key, gone);
            }
            self.io.push(Io::Delete(older));
            if newer != f.id {
                return;
            }
        }
        self.next = self.next.max(f.id);
        self.tick += 1;
        let lease = f.header.lease;
        self.files.insert(f.id, Held { owned: true, holders: 0 });
        if let Some(t) = lease.deadline() {
            self.expiring.insert((t, key.clone()));
        }
        self.objs.insert(
            key,
            Obj {
                id: f.id,
                meta: f.header.meta,
                len: f.header.len,
                retention: lease.retention,
                pins: 0,
                tick: self.tick,
                loc: Loc::Spilled,
                consumers: lease.consumers,
                early: 0,
                expires: lease.deadline(),
            },
        );
    }

    /// A block for `len` bytes, evicting as needed.
    fn place(&mut self, len: u64) -> Result<Step<u64>> {
        let started = self.spilling;
        loop {
            if let Some(off) = self.new_block(len) {
                return Ok(Step::Done(off));
            }
            if self.spilling > started && self.spilling >= len {
                return Ok(Step::Wait); // enough room is on its way
            }
            if !self.evict_one() {
                if self.spilling > 0 {
                    return Ok(Step::Wait);
                }
                return Err(StoreError::Capacity {
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
    fn rebalance(&mut self) {
        if self.alloc.used().saturating_sub(self.spilling) > self.marks.high {
            while self.alloc.used().saturating_sub(self.spilling) > self.marks.low
                && self.evict_one()
            {}
        }
    }

    // --- puts ---

    /// Reserves a block for a put of `key`.
    pub(crate) fn reserve(
        &mut self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        retention: Retention,
        deadline: Instant,
    ) -> Result<Step<Reserved>> {
        if self.objs.contains_key(key) || self.pending.values().any(|p| p.key == key) {
            return Err(exists(key));
        }
        if len > self.alloc.capacity() {
            return Err(StoreError::Capacity {
                what: "store object larger than the pool".into(),
                requested: len,
                limit: self.alloc.capacity(),
            });
        }
        let off = match self.place(len)? {
            Step::Done(off) => off,
            Step::Wait => return Ok(Step::Wait),
        };
        let (ticket, id) = (self.next_id(), self.next_id());
        let p =
            Pending { key: key.to_vec(), id, off, len, meta: meta.clone(), retention, deadline };
        self.pending.insert(ticket, p);
        Ok(Step::Done(Reserved { ticket, off }))
    }

    /// Publishes a reserved put.
    pub(crate) fn commit(&mut self, ticket: u64) -> Result<()> {
        let p = self.pending.remove(&ticket).ok_or_else(|| {
            StoreError::InvalidArgument(format!("store put {ticket} expired or already finished"))
        })?;
        let obj = Obj {
            id: p.id,
            meta: p.meta,
            len: p.len,
            retention: p.retention,
            pins: 0,
            tick: 0,
            loc: Loc::Pool(p.off),
            consumers: 0,
            early: 0,
            expires: None,
        };
        self.objs.insert(p.key.clone(), obj);
        self.relist(&p.key, true);
        self.rebalance();
        Ok(())
    }

    /// Drops a reserved put.
    pub(crate) fn abort(&mut self, ticket: u64) {
        if let Some(p) = self.pending.remove(&ticket) {
            self.release(Hold::Block(p.off), false);
        }
    }

    // --- reads ---

    /// Opens a read of `key`: its bytes (block or file) stay until the read is closed. With
    /// `in_pool`, a spilled object is placed in the pool first and the read carries the
    /// [`LoadJob`] that fills its block.
    pub(crate) fn open(
        &mut self,
        key: &[u8],
        deadline: Instant,
        in_pool: bool,
    ) -> Result<Step<Opened>> {
        let Some(o) = self.objs.get(key) else {
            metrics::counter!("tensorwire_store_gets_total", "result" => "miss").increment(1);
            return Err(StoreError::not_found(key));
        };
        metrics::counter!("tensorwire_store_gets_total", "result" => "hit").increment(1);
        let (id, len, meta) = (o.id, o.len, o.meta.clone());
        let (hold, source, load) = match (o.loc, in_pool) {
            (Loc::Pool(off) | Loc::Spilling(off), _) => (Hold::Block(off), Source::Pool(off), None),
            (Loc::Spilled | Loc::Loading(_), false) => (Hold::File(id), Source::File, None),
            (Loc::Loading(_), true) => return Ok(Step::Wait), // another read is loading it
            (Loc::Spilled, true) => {
                let off = match self.place(len)? {
                    Step::Done(off) => off,
                    Step::Wait => return Ok(Step::Wait),
                };
                let job = LoadJob { id, key: key.to_vec(), len, off };
                if let Some(o) = self.objs.get_mut(key) {
                    o.loc = Loc::Loading(off);
                }
                (Hold::Block(off), Source::Pool(off), Some(job))
            }
        };
        self.hold(hold);
        self.relist(key, true);
        let ticket = self.next_id();
        self.reading.insert(ticket, Reading { hold, deadline, key: key.to_vec() });
        Ok(Step::Done(Opened { ticket, id, meta, len, source, load }))
    }

    /// Closes a read.
    pub(crate) fn close(&mut self, ticket: u64, key: &[u8]) {
        if let Some(r) = self.reading.remove(&ticket) {
            self.release(r.hold, true);
            self.relist(key, false);
        }
    }

    /// A load into the pool finished: the object is back in its block (and its file goes), or,
    /// when `ok` is false, it stays in the spill tier (the caller closes its read).
    pub(crate) fn loaded(&mut self, job: &LoadJob, ok: bool) {
        let Some(o) = self.objs.get_mut(&job.key).filter(|o| o.id == job.id) else {
            self.release(Hold::Block(job.off), false); // removed meanwhile
            return;
        };
        if ok {
            o.loc = Loc::Pool(job.off);
            self.release(Hold::File(job.id), false);
        } else {
            o.loc = Loc::Spilled;
            self.release(Hold::Block(job.off), false);
        }
        self.relist(&job.key, false);
    }

    /// A spill finished: the object now lives in its file and its block is freed once no read
    /// holds it; or, when `ok` is false, it stays in the pool.
    pub(crate) fn spilled(&mut self, job: &SpillJob, ok: bool) {
        self.spilling = self.spilling.saturating_sub(job.size);
        let live = self.objs.get_mut(&job.key).filter(|o| o.id == job.id);
        match (live, ok) {
            (Some(o), true) => {
                metrics::counter!("tensorwire_store_spills_total").increment(1);
                metrics::counter!("tensorwire_store_spill_bytes_total").increment(job.size);
                o.loc = Loc::Spilled;
                self.files.insert(job.id, Held { owned: true, holders: 0 });
                self.release(Hold::Block(job.off), false);
            }
            (Some(o), false) => o.loc = Loc::Pool(job.off),
            (None, _) => self.io.push(Io::Delete(job.id)), // removed while spilling
        }
        self.release(Hold::Block(job.off), true);
        self.relist(&job.key, false);
    }

    // --- the rest of the API ---

    /// Removes `key`; false if it was not there. Its block and file go once no read holds them.
    pub(crate) fn remove(&mut self, key: &[u8]) -> bool {
        let Some(o) = self.objs.get(key) else { return false };
        let (slot, id, loc, expires) = ((o.class(), o.tick), o.id, o.loc, o.expires);
        self.lru.remove(&slot);
        self.objs.remove(key);
        self.unlist_expiry(key, expires);
        match loc {
            Loc::Pool(off) | Loc::Spilling(off) => self.release(Hold::Block(off), false),
            Loc::Spilled => self.release(Hold::File(id), false),
            Loc::Loading(off) => {
                self.release(Hold::Block(off), false);
                self.release(Hold::File(id), false);
            }
        }
        true
    }

    pub(crate) fn exists(&self, key: &[u8]) -> bool {
        self.objs.contains_key(key)
    }

    pub(crate) fn pin(&mut self, key: &[u8], up: bool) -> Result<()> {
        let o = self.objs.get_mut(key).ok_or_else(|| StoreError::not_found(key))?;
        if up {
            o.pins += 1;
        } else if o.pins == 0 {
            return Err(StoreError::InvalidArgument(format!(
                "store key {} is not pinned",
                StoreKey(key.to_vec())
            )));
        } else {
            o.pins -= 1;
        }
        self.relist(key, false);
        Ok(())
    }

    /// Sets an object's lease: the number of consumers that will call `consumed` (0: not
    /// counted) and a time after which it is removed. Consumers that reported before are
    /// counted against the count: when they are all of it, the object goes now.
    pub(crate) fn set_lease(
        &mut self,
        key: &[u8],
        consumers: u32,
        expires: Option<Instant>,
    ) -> Result<()> {
        let o = self.objs.get_mut(key).ok_or_else(|| StoreError::not_found(key))?;
        let before = std::mem::replace(&mut o.expires, expires);
        o.consumers = consumers.saturating_sub(o.early);
        let done = consumers > 0 && o.consumers == 0;
        o.early = 0;
        self.unlist_expiry(key, before);
        if let Some(t) = expires {
            self.expiring.insert((t, key.to_vec()));
        }
        if done {
            self.remove(key);
        }
        Ok(())
    }

    /// One consumer is done; true when it was the last and the object is gone. A report that
    /// comes before the object has a consumer count (the producer sets it right after its put,
    /// and a fast consumer can get there first) is kept for when it is set, up to
    /// [`MAX_EARLY`]; more than that is a caller that never sets one.
    pub(crate) fn consumed(&mut self, key: &[u8]) -> Result<bool> {
        let o = self.objs.get_mut(key).ok_or_else(|| StoreError::not_found(key))?;
        if o.consumers == 0 {
            if o.early >= MAX_EARLY {
                return Err(StoreError::InvalidArgument(format!(
                    "store key {}: {} consumers reported and no consumer count was set",
                    StoreKey(key.to_vec()),
                    o.early
                )));
            }
            o.early += 1;
            return Ok(false);
        }
        o.consumers -= 1;
        Ok(o.consumers == 0 && self.remove(key))
    }

    /// Aborts pending puts and closes read leases past their deadline, and removes objects whose
    /// lease time has passed.
    pub(crate) fn expire(&mut self, now: Instant) {
        let dead: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(&t, _)| t).collect();
        for t in dead {
            self.abort(t);
        }
        let dead: Vec<u64> =
            self.reading.iter().filter(|(_, r)| r.deadline <= now).map(|(&t, _)| t).collect();
        for t in dead {
            if let Some(r) = self.reading.remove(&t) {
                self.release(r.hold, true);
                // The object may be evictable again.
                self.relist(&r.key, false);
            }
        }
        let mut due = Vec::new();
        while self.expiring.first().is_some_and(|(t, _)| *t <= now) {
            let Some((_, key)) = self.expiring.pop_first() else { break };
            due.push(key);
        }
        metrics::counter!("tensorwire_store_lease_expiries_total").increment(due.len() as u64);
        for key in due {
            self.remove(&key);
        }
    }

    /// Takes `key`'s entry (with lease time `at`) out of the expiry index.
    fn unlist_expiry(&mut self, key: &[u8], at: Option<Instant>) {
        if let Some(t) = at {
            self.expiring.remove(&(t, key.to_vec()));
        }
    }

    /// Up to `limit` objects with keys after `after`, in key order (a page of the listing a
    /// cluster's repair reads).
    pub(crate) fn list(&self, after: &[u8], limit: usize, now: Instant) -> Vec<ObjectInfo> {
        let mut keys: Vec<&Vec<u8>> = self.objs.keys().filter(|k| k.as_slice() > after).collect();
        keys.sort_unstable();
        keys.truncate(limit);
        keys.into_iter()
            .map(|k| {
                let o = &self.objs[k];
                ObjectInfo {
                    key: k.clone(),
                    len: o.len,
                    retention: o.retention,
                    pins: o.pins,
                    consumers: o.consumers,
                    early: o.early,
                    ttl_left: o.expires.map(|t| t.saturating_duration_since(now)),
                }
            })
            .collect()
    }

    pub(crate) fn stats(&self) -> StoreStats {
        let in_pool = |o: &&Obj| matches!(o.loc, Loc::Pool(_) | Loc::Spilling(_));
        let objects = self.objs.values().filter(in_pool).count() as u64;
        StoreStats {
            capacity: self.alloc.capacity(),
            used: self.alloc.used(),
            objects,
            spilled_objects: self.objs.len() as u64 - objects,
            evictions: self.evictions,
            largest_free: self.alloc.largest_free(),
        }
    }

    /// Publishes the pool's levels through the `metrics` facade (walks every object: call it
    /// every so often).
    pub(crate) fn publish_metrics(&self) {
        let st = self.stats();
        metrics::gauge!("tensorwire_store_objects").set(st.objects as f64);
        metrics::gauge!("tensorwire_store_bytes").set(st.used as f64);
        metrics::gauge!("tensorwire_store_capacity_bytes").set(st.capacity as f64);
        metrics::gauge!("tensorwire_store_spilled_objects").set(st.spilled_objects as f64);
        let pinned = self.objs.values().filter(|o| o.pins > 0).count();
        metrics::gauge!("tensorwire_store_pinned_objects").set(pinned as f64);
    }

    /// The id of `key` if it is in the spill tier only.
    pub(crate) fn spilled_id(&self, key: &[u8]) -> Option<u64> {
        self.objs.get(key).filter(|o| o.loc == Loc::Spilled).map(|o| o.id)
    }

    /// Every spill file that exists (for cleanup when the store is dropped).
    pub(crate) fn files(&self) -> Vec<u64> {
        self.files.keys().copied().collect()
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

    const P: u64 = 4096;

    fn meta(n: u64) -> TensorMeta {
        TensorMeta::contiguous(DType::U8, &[n])
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// A put, carrying out the state's IO at once (spills succeed); returns the keys spilled or
    /// dropped on the way.
    fn put(s: &mut PoolState, key: &str, len: u64, r: Retention) -> Result<Vec<String>> {
        let mut victims = Vec::new();
        let t = loop {
            let step = s.reserve(key.as_bytes(), &meta(len), len, r, far());
            victims.extend(drain(s));
            match step? {
                Step::Done(t) => break t,
                Step::Wait => continue,
            }
        };
        s.commit(t.ticket)?;
        victims.extend(drain(s));
        Ok(victims)
    }

    /// Completes every queued spill successfully; returns the spilled keys.
    fn drain(s: &mut PoolState) -> Vec<String> {
        let mut done = Vec::new();
        for io in s.take_io() {
            if let Io::Spill(j) = io {
                done.push(String::from_utf8(j.key.clone()).unwrap());
                s.spilled(&j, true);
            }
        }
        done
    }

    /// DeleteOnConsume{n} for n = 1..4, with 0..=n consumers reporting before the count is set:
    /// the object stays through the first n - 1 reports and goes at the n-th, exactly.
    #[test]
    fn the_last_of_n_consumers_removes_the_object_and_no_earlier_one() {
        for n in 1..=4u32 {
            for early in 0..=n {
                let mut s = PoolState::new(40 * P, Marks { high: 40 * P, low: 30 * P }, false);
                put(&mut s, "k", P, Retention::Pinned).unwrap();
                for _ in 0..early {
                    assert!(!s.consumed(b"k").unwrap(), "n={n}: an early report is kept");
                }
                s.set_lease(b"k", n, None).unwrap();
                for i in early + 1..n {
                    assert!(!s.consumed(b"k").unwrap(), "n={n}, early={early}: report {i} of {n}");
                    assert!(s.exists(b"k"), "n={n}, early={early}: gone after {i} of {n}");
                }
                if early < n {
                    assert!(s.consumed(b"k").unwrap(), "n={n}, early={early}: the n-th removes it");
                }
                assert!(!s.exists(b"k"), "n={n}, early={early}: still there after {n} of {n}");
                assert!(matches!(s.consumed(b"k"), Err(StoreError::NotFound { .. })));
            }
        }
    }

    /// A TTL-only lease (no consumer count) leaves the object until its time, and removes it
    /// then, not before.
    #[test]
    fn a_ttl_removes_the_object_at_its_time_and_not_before() {
        let mut s = PoolState::new(40 * P, Marks { high: 40 * P, low: 30 * P }, false);
        put(&mut s, "t", P, Retention::Pinned).unwrap();
        let t0 = Instant::now();
        s.set_lease(b"t", 0, Some(t0 + Duration::from_secs(10))).unwrap();
        assert!(s.exists(b"t"), "a lease without a consumer count removed the object at once");
        s.expire(t0 + Duration::from_secs(9));
        assert!(s.exists(b"t"), "expired before its time");
        s.expire(t0 + Duration::from_secs(10));
        assert!(!s.exists(b"t"), "still there at its time");
    }

    /// Leases expire by their own times through the expiry index: a lease moved earlier or
    /// later counts at its new time only, a removed object's old time removes nothing put
    /// under its key since, and objects without a lease stay.
    #[test]
    fn leases_expire_at_their_latest_times_only() {
        let mut s = PoolState::new(40 * P, Marks { high: 40 * P, low: 30 * P }, false);
        let t0 = Instant::now();
        let at = |secs: u64| Some(t0 + Duration::from_secs(secs));
        for k in ["a", "b", "c", "d"] {
            put(&mut s, k, P, Retention::Normal).unwrap();
        }
        s.set_lease(b"a", 0, at(10)).unwrap();
        s.set_lease(b"b", 0, at(5)).unwrap();
        s.set_lease(b"c", 0, at(3)).unwrap();
        s.set_lease(b"c", 0, at(20)).unwrap(); // moved later
        s.set_lease(b"a", 0, at(2)).unwrap(); // moved earlier
        s.set_lease(b"d", 0, at(4)).unwrap();
        assert!(s.remove(b"d"));
        put(&mut s, "d", P, Retention::Normal).unwrap(); // no lease this time
        s.expire(t0 + Duration::from_secs(3));
        assert!(!s.exists(b"a"), "a's lease moved to 2 s");
        assert!(s.exists(b"b") && s.exists(b"c"), "removed before their time");
        s.expire(t0 + Duration::from_secs(6));
        assert!(!s.exists(b"b"));
        assert!(s.exists(b"c"), "c's lease was moved to 20 s");
        assert!(s.exists(b"d"), "the old d's time removed the new d");
        s.expire(t0 + Duration::from_secs(60));
        assert!(!s.exists(b"c"));
        assert!(s.exists(b"d"), "an object without a lease expired");
        assert!(s.expiring.is_empty(), "the index keeps {} entries", s.expiring.len());
    }

    #[test]
    fn a_consumer_faster_than_the_lease_is_counted_when_it_comes() {
        let mut s = PoolState::new(40 * P, Marks { high: 40 * P, low: 30 * P }, false);
        put(&mut s, "a", P, Retention::Pinned).unwrap();
        // Consumed between the put and the producer's set_lease: kept, then counted.
        assert!(!s.consumed(b"a").unwrap());
        assert!(s.exists(b"a"));
        s.set_lease(b"a", 2, None).unwrap();
        assert!(s.exists(b"a"), "one of two consumers is still to come");
        assert!(s.consumed(b"a").unwrap(), "the second one removes it");
        // Every consumer came first: the lease removes it at once.
        put(&mut s, "b", P, Retention::Pinned).unwrap();
        s.consumed(b"b").unwrap();
        s.set_lease(b"b", 1, None).unwrap();
        assert!(!s.exists(b"b"));
        // A caller that never sets a count is told, past the bound.
        put(&mut s, "c", P, Retention::Pinned).unwrap();
        for _ in 0..MAX_EARLY {
            s.consumed(b"c").unwrap();
        }
        assert!(s.consumed(b"c").is_err());
    }

    #[test]
    fn lru_order_soft_last_pinned_never() {
        let mut s = PoolState::new(40 * P, Marks { high: 40 * P, low: 30 * P }, false);
        let mut evicted = Vec::new();
        let mut put_pages = |s: &mut PoolState, k: &str, n: u64, r: Retention| {
            let before: Vec<Vec<u8>> = s.objs.keys().cloned().collect();
            put(s, k, n * P, r).unwrap();
            for b in before {
                if !s.exists(&b) {
                    evicted.push(String::from_utf8(b).unwrap());
                }
            }
            evicted.clone()
        };
        put_pages(&mut s, "soft", 10, Retention::Soft);
        put_pages(&mut s, "pinned", 10, Retention::Pinned);
        put_pages(&mut s, "a", 10, Retention::Normal);
        put_pages(&mut s, "b", 10, Retention::Normal);
        let Step::Done(r) = s.open(b"a", far(), false).unwrap() else { panic!() };
        assert_eq!(put_pages(&mut s, "c", 10, Retention::Normal), ["b"], "a is being read");
        assert_eq!(put_pages(&mut s, "d", 10, Retention::Normal), ["b", "c"]);
        s.close(r.ticket, b"a");
        assert_eq!(put_pages(&mut s, "e", 10, Retention::Normal), ["b", "c", "a"]);
        s.pin(b"d", true).unwrap();
        s.pin(b"e", true).unwrap();
        assert_eq!(put_pages(&mut s, "f", 10, Retention::Normal).last().unwrap(), "soft");
        assert!(s.exists(b"pinned"));
        let e = put(&mut s, "huge", 41 * P, Retention::Normal).unwrap_err();
        assert!(matches!(e, StoreError::Capacity { .. }), "{e}");
    }

    #[test]
    fn a_victims_block_is_reused_only_after_its_spill_reported() {
        let mut s = PoolState::new(4 * P, Marks { high: 4 * P, low: 4 * P }, true);
        put(&mut s, "old", 4 * P, Retention::Normal).unwrap();
        let step = s.reserve(b"new", &meta(4 * P), 4 * P, Retention::Normal, far()).unwrap();
        assert!(matches!(step, Step::Wait), "room comes only when the spill is done");
        let io = s.take_io();
        let [Io::Spill(job)] = &io[..] else { panic!("{io:?}") };
        assert_eq!(s.stats().used, 4 * P, "the victim's block is still held by its spill");
        let Step::Done(r) = s.open(b"old", far(), false).unwrap() else { panic!("readable") };
        s.spilled(job, true);
        assert_eq!(s.stats().spilled_objects, 1);
        let e = s.reserve(b"new", &meta(4 * P), 4 * P, Retention::Normal, far()).unwrap_err();
        assert!(matches!(e, StoreError::Capacity { .. }), "a read still holds the old block: {e}");
        s.close(r.ticket, b"old");
        let step = s.reserve(b"new", &meta(4 * P), 4 * P, Retention::Normal, far()).unwrap();
        assert!(matches!(step, Step::Done(_)), "the block is free once the read closed");
    }

    #[test]
    fn a_failed_spill_keeps_the_object_and_a_removed_one_loses_its_file() {
        let mut s = PoolState::new(2 * P, Marks { high: 2 * P, low: 2 * P }, true);
        put(&mut s, "a", P, Retention::Normal).unwrap();
        put(&mut s, "b", P, Retention::Normal).unwrap();
        assert!(matches!(
            s.reserve(b"c", &meta(P), P, Retention::Normal, far()).unwrap(),
            Step::Wait
        ));
        let Some(Io::Spill(job)) = s.take_io().pop() else { panic!() };
        s.spilled(&job, false);
        assert_eq!(s.stats().objects, 2, "a failed spill leaves the victim in the pool");
        assert!(matches!(
            s.reserve(b"c", &meta(P), P, Retention::Normal, far()).unwrap(),
            Step::Wait
        ));
        let Some(Io::Spill(job)) = s.take_io().pop() else { panic!() };
        assert!(s.remove(&job.key));
        s.spilled(&job, true);
        assert!(
            matches!(&s.take_io()[..], [Io::Delete(id)] if *id == job.id),
            "the file of an object removed while spilling is deleted"
        );
        assert_eq!(s.stats().used, P);
    }

    #[test]
    fn loading_back_and_a_failed_load() {
        let mut s = PoolState::new(2 * P, Marks { high: 0, low: 0 }, true);
        put(&mut s, "a", P, Retention::Normal).unwrap();
        assert_eq!(s.stats().spilled_objects, 1, "above the high mark: spilled at once");
        let Step::Done(o) = s.open(b"a", far(), true).unwrap() else { panic!() };
        let job = o.load.clone().expect("a spilled object is loaded for an in-pool read");
        assert!(matches!(s.open(b"a", far(), true).unwrap(), Step::Wait), "one load at a time");
        s.loaded(&job, false);
        s.close(o.ticket, b"a");
        assert_eq!((s.stats().used, s.stats().spilled_objects), (0, 1));
        let Step::Done(o) = s.open(b"a", far(), true).unwrap() else { panic!() };
        s.loaded(o.load.as_ref().unwrap(), true);
        assert!(matches!(&s.take_io()[..], [Io::Delete(_)]), "the file goes once loaded");
        s.close(o.ticket, b"a");
        assert_eq!((s.stats().objects, s.stats().spilled_objects), (1, 0));
    }

    #[test]
    fn expiry_frees_abandoned_puts_and_reads() {
        let mut s = PoolState::new(10 * P, Marks { high: 10 * P, low: 10 * P }, false);
        let now = Instant::now();
        let soon = now + Duration::from_millis(10);
        s.reserve(b"x", &meta(P), P, Retention::Normal, soon).unwrap();
        put(&mut s, "y", P, Retention::Normal).unwrap();
        s.open(b"y", soon, false).unwrap();
        s.remove(b"y");
        assert_eq!(s.stats().used, 2 * P, "pending put and read-held block");
        s.expire(now + Duration::from_millis(20));
        assert_eq!(s.stats().used, 0);
    }

    proptest! {
        /// Random puts, reads, pins, removes and spills completing late (or failing): held objects
        /// are never evicted, a spilling block stays allocated until its spill is reported, used
        /// bytes always equal live blocks, and once everything is closed and removed nothing is
        /// left (every spill file created is deleted).
        #[test]
        fn holds_and_io_are_consistent(
            spill in any::<bool>(),
            ops in proptest::collection::vec((0u8..8, 0u8..10, 1u64..6), 1..300),
        ) {
            let mut s = PoolState::new(48 * P, Marks { high: 40 * P, low: 28 * P }, spill);
            let mut jobs: Vec<SpillJob> = Vec::new();
            let mut files = std::collections::HashSet::new();
            let mut reads: Vec<(Vec<u8>, u64, u64)> = Vec::new(); // key, ticket, object id
            let mut pins: HashMap<Vec<u8>, u32> = HashMap::new();
            for (op, k, n) in ops {
                let key = format!("k{k}").into_bytes();
                match op {
                    0 | 1 => {
                        let r = if n == 5 { Retention::Pinned } else { Retention::Normal };
                        if let Ok(Step::Done(t)) = s.reserve(&key, &meta(n * P), n * P, r, far()) {
                            s.commit(t.ticket).unwrap();
                        }
                    }
                    2 => if let Ok(Step::Done(o)) = s.open(&key, far(), n % 2 == 0) {
                        if let Some(j) = &o.load { s.loaded(j, n != 4); }
                        reads.push((key, o.ticket, o.id));
                    },
                    3 => if let Some((k, t, _)) = reads.pop() { s.close(t, &k); },
                    4 => if s.pin(&key, true).is_ok() { *pins.entry(key).or_default() += 1; },
                    5 => if s.pin(&key, false).is_ok() { *pins.entry(key).or_default() -= 1; },
                    6 => { s.remove(&key); pins.remove(&key); }
                    _ => if !jobs.is_empty() {
                        let j = jobs.remove(n as usize % jobs.len());
                        if n == 3 { files.remove(&j.id); } // a failed write leaves no file
                        s.spilled(&j, n != 3);
                    },
                }
                for io in s.take_io() {
                    match io {
                        Io::Spill(j) => {
                            let held = pins.get(&j.key).copied().unwrap_or(0) > 0
                                || reads.iter().any(|r| r.2 == j.id);
                            prop_assert!(!held, "evicted a held object");
                            prop_assert!(!jobs.iter().any(|x| x.off == j.off), "two spills of a block");
                            files.insert(j.id);
                            jobs.push(j);
                        }
                        Io::Delete(id) => { files.remove(&id); }
                    }
                }
                for j in &jobs {
                    prop_assert!(s.blocks.contains_key(&j.off), "a spilling block was freed");
                }
                let live: u64 = s.blocks.values().map(|b| b.size).sum();
                prop_assert_eq!(s.stats().used, live);
                for o in s.objs.values() {
                    prop_assert!(o.retention != Retention::Pinned || matches!(o.loc, Loc::Pool(_)), "a Pinned object left the pool");
                }
            }
            for j in std::mem::take(&mut jobs) { s.spilled(&j, true); }
            for (k, t, _) in reads { s.close(t, &k); }
            let keys: Vec<Vec<u8>> = s.objs.keys().cloned().collect();
            for k in keys { s.remove(&k); }
            for io in s.take_io() {
                if let Io::Delete(id) = io { files.remove(&id); }
            }
            prop_assert_eq!(s.stats().used, 0);
            prop_assert!(s.files.is_empty() && files.is_empty(), "spill files left: {:?}", files);
        }
    }
}
