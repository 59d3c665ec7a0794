//! The embedded store: a pool region registered with the local engine, its bookkeeping in the
//! sans-IO [`PoolState`], and an optional file spill tier. Every call locks the state only for
//! bookkeeping; the IO the state asks for (spilling victims, deleting files, loading a spilled
//! object back) runs after the lock is released, and callers that need room wait (bounded) for
//! spills in flight. Copies between caller regions and the pool go through the memory seam
//! (`MemSlice::copy_from`: kind-checked, one copy).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::{Condvar, Mutex, MutexGuard};
use tensorwire_core::ClusterSecret;
use tensorwire_core::{Engine, MemSlice, Permissions, Region, RemoteRegion, TensorMeta};

use crate::api::{ObjectInfo, Retention, Store, StoreStats, check_key, check_meta};
use crate::error::{Result, StoreError};
use crate::spill::Spill;
use crate::state::{Io, LoadJob, Marks, Opened, PoolState, Reserved, Source, Step, deadline};

/// Embedded store settings.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Pool bytes (registered host memory).
    pub capacity: u64,
    /// Evict once used bytes exceed this fraction of capacity...
    pub high_watermark: f64,
    /// ...down to this fraction.
    pub low_watermark: f64,
    /// Spill evicted objects to this directory instead of dropping them.
    pub spill_dir: Option<PathBuf>,
    /// The spill tier outlives the store: at start, the objects in `spill_dir` are found again
    /// (each file's bytes checked; a bad file is deleted with a log line);
    /// [`EmbeddedStore::shutdown`] writes the objects still in the pool there; dropping the
    /// store leaves the files. Without it, the store deletes its files when dropped.
    pub persist: bool,
    /// Let peers of the engine read and write the pool (needed to serve it as a store node).
    pub shared: bool,
    /// A reserved put not committed within this time is dropped (a client that died mid-put).
    /// It also bounds how long a put waits for spills to make room.
    pub put_ttl: Duration,
    /// A read lease not closed within this time is dropped (a reader that died mid-get).
    pub read_ttl: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            capacity: 256 << 20,
            high_watermark: 0.95,
            low_watermark: 0.85,
            spill_dir: None,
            persist: false,
            shared: false,
            put_ttl: Duration::from_secs(30),
            read_ttl: Duration::from_secs(30),
        }
    }
}

/// A put in progress: the pool offset its bytes go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingPut {
    /// Reservation ticket.
    pub ticket: u64,
    /// Offset in the pool region.
    pub offset: u64,
}

/// An open read of the pool (for a store node): where the object is and what it is.
#[derive(Debug, Clone)]
pub(crate) struct PoolRead {
    pub(crate) ticket: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) meta: TensorMeta,
}

/// A store living in this process.
#[derive(Debug)]
pub struct EmbeddedStore {
    pool: Region,
    state: Mutex<PoolState>,
    /// Signalled whenever a spill or load finishes (room may have appeared).
    io_done: Condvar,
    spill: Option<Spill>,
    cfg: StoreConfig,
    /// The engine's cluster secret and opt-out, which a store node serving this store applies.
    pub(crate) secret: Option<ClusterSecret>,
    pub(crate) insecure: bool,
    /// The engine's control address, which a store node tells its clients.
    pub(crate) engine_addr: std::net::SocketAddr,
}

impl EmbeddedStore {
    /// Allocates the pool from `engine` and starts empty.
    pub async fn new(engine: &Engine, cfg: StoreConfig) -> Result<Arc<EmbeddedStore>> {
        if !(0.0..=1.0).contains(&cfg.low_watermark)
            || !(cfg.low_watermark..=1.0).contains(&cfg.high_watermark)
        {
            return Err(StoreError::InvalidArgument(format!(
                "store watermarks must satisfy 0 <= low ({}) <= high ({}) <= 1",
                cfg.low_watermark, cfg.high_watermark
            )));
        }
        let perms = if cfg.shared { Permissions::READ_WRITE } else { Permissions::NONE };
        let pool = engine.alloc(cfg.capacity, perms).await?;
        let cap = pool.len() / crate::alloc::ALIGN * crate::alloc::ALIGN;
        let marks = Marks {
            high: (cap as f64 * cfg.high_watermark) as u64,
            low: (cap as f64 * cfg.low_watermark) as u64,
        };
        let spill = cfg.spill_dir.as_deref().map(Spill::new).transpose()?;
        let mut state = PoolState::new(cap, marks, spill.is_some());
        if let (Some(s), true) = (&spill, cfg.persist) {
            let found = s.scan()?;
            let bytes: u64 = found.iter().map(|f| f.header.len).sum();
            let n = found.len();
            for f in found {
                state.recover(f);
            }
            for io in state.take_io() {
                if let Io::Delete(id) = io {
                    s.remove(id);
                }
            }
            if n > 0 {
                tracing::info!(objects = n, bytes, "store: objects found in the spill tier");
            }
        }
        Ok(Arc::new(EmbeddedStore {
            pool,
            state: Mutex::new(state),
            io_done: Condvar::new(),
            spill,
            cfg,
            secret: engine.config().cluster_secret.clone(),
            insecure: engine.config().insecure,
            engine_addr: engine.local_addr(),
        }))
    }

    /// The pool region as peers see it (for a store node).
    pub fn pool(&self) -> RemoteRegion {
        self.pool.remote()
    }

    /// Whether spill writes use O_DIRECT (None without a spill tier).
    pub fn spill_direct(&self) -> Option<bool> {
        self.spill.as_ref().map(Spill::direct)
    }

    /// How the spill tier does its file I/O, detected at start (None without a spill tier).
    pub fn spill_io(&self) -> Option<String> {
        self.spill.as_ref().map(Spill::describe)
    }

    /// The spill file of `key`, if it is in the spill tier only (tests corrupt it).
    pub fn spill_file(&self, key: &[u8]) -> Option<PathBuf> {
        let id = self.state.lock().spilled_id(key)?;
        Some(self.spill.as_ref()?.file(id))
    }

    /// Locks the state with expired puts, reads and leased objects swept first.
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        let mut st = self.state.lock();
        st.expire(Instant::now());
        st
    }

    /// Runs `f` on the state, then the IO it queued (outside the lock). `f` answering
    /// [`Step::Wait`] (spills in flight will make room) is retried once the IO ran or another
    /// caller's finished, for at most the put TTL.
    fn run<T>(&self, mut f: impl FnMut(&mut PoolState) -> Result<Step<T>>) -> Result<T> {
        let give_up = Instant::now() + self.cfg.put_ttl;
        loop {
            let (step, io) = {
                let mut st = self.lock();
                let step = f(&mut st);
                (step, st.take_io())
            };
            let ran = !io.is_empty();
            let io_result = self.carry_out(io);
            match step? {
                Step::Done(t) => return Ok(t),
                Step::Wait => io_result?,
            }
            if !ran {
                let now = Instant::now();
                if now >= give_up {
                    return Err(StoreError::Engine(tensorwire_core::Error::timeout(
                        "waiting for the spill tier to make room in the store pool",
                        self.cfg.put_ttl,
                    )));
                }
                let mut st = self.state.lock();
                self.io_done.wait_for(&mut st, (give_up - now).min(Duration::from_millis(50)));
            }
        }
    }

    /// Carries out queued IO: spills (reporting each back to the state) and file deletions.
    /// Blocking file I/O, so it leaves the async worker's critical path where it can. Returns the
    /// first spill failure (the victim stays in the pool).
    fn carry_out(&self, io: Vec<Io>) -> Result<()> {
        if io.is_empty() {
            return Ok(());
        }
        let work = || {
            let mut first = Ok(());
            for job in io {
                match job {
                    Io::Delete(id) => {
                        if let Some(s) = &self.spill {
                            s.remove(id);
                        }
                    }
                    Io::Spill(j) => {
                        let r = self.spill.as_ref().ok_or_else(|| {
                            StoreError::Internal("a spill without a spill tier".into())
                        });
                        let r = r.and_then(|s| {
                            let block = self.pool.slice(j.off, j.size)?;
                            let written = s.write(j.id, &j.key, &j.meta, &j.lease, &block, j.len);
                            if written.is_err() {
                                s.remove(j.id); // no partial file is left behind
                            }
                            written
                        });
                        self.state.lock().spilled(&j, r.is_ok());
                        self.io_done.notify_all();
                        if let Err(e) = r {
                            tracing::warn!(error = %e, "store: spilling an evicted object failed");
                            if first.is_ok() {
                                first = Err(e);
                            }
                        }
                    }
                }
            }
            first
        };
        let r = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
            _ => work(),
        };
        // Spill reports may have queued deletions (objects removed while spilling).
        let more = self.state.lock().take_io();
        self.carry_out(more)?;
        r
    }

    // --- the two-phase forms a store node (and a producer writing in place) uses ---

    /// Reserves pool space for `key` and returns where to write it; publish with
    /// [`EmbeddedStore::commit_put`]. Not committed within `put_ttl`, the space is reclaimed.
    pub fn begin_put(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        r: Retention,
    ) -> Result<PendingPut> {
        let res = self.reserve(key, meta, len, r)?;
        Ok(PendingPut { ticket: res.ticket, offset: res.off })
    }

    /// Publishes a put begun with [`EmbeddedStore::begin_put`].
    pub fn commit_put(&self, p: PendingPut) -> Result<()> {
        self.commit(p.ticket)
    }

    fn reserve(&self, key: &[u8], meta: &TensorMeta, len: u64, r: Retention) -> Result<Reserved> {
        check_key(key)?;
        check_meta(meta, len)?;
        let ttl = deadline(self.cfg.put_ttl);
        self.run(|st| st.reserve(key, meta, len, r, ttl))
    }

    pub(crate) fn commit(&self, ticket: u64) -> Result<()> {
        self.run(|st| st.commit(ticket).map(Step::Done))
    }

    pub(crate) fn abort(&self, ticket: u64) {
        let _ = self.run(|st| {
            st.abort(ticket);
            Ok(Step::Done(()))
        });
    }

    /// Opens a read; with `in_pool`, a spilled object is loaded back into the pool first.
    fn open(&self, key: &[u8], in_pool: bool) -> Result<Opened> {
        check_key(key)?;
        let ttl = deadline(self.cfg.read_ttl);
        let opened = self.run(|st| st.open(key, ttl, in_pool))?;
        if let Some(job) = &opened.load {
            if let Err(e) = self.load(job) {
                self.close(opened.ticket, key);
                return Err(e);
            }
        }
        Ok(opened)
    }

    /// Reads a spilled object back into the pool block its read holds (outside the lock).
    fn load(&self, job: &LoadJob) -> Result<()> {
        let r = (|| {
            let spill = self.spill.as_ref().ok_or_else(|| StoreError::not_found(&job.key))?;
            let block = self.pool.slice(job.off, job.len)?;
            spill.read_into(job.id, &job.key, &block)
        })();
        self.run(|st| {
            st.loaded(job, r.is_ok());
            Ok(Step::Done(()))
        })?;
        self.io_done.notify_all();
        r.map(drop)
    }

    /// Opens a read for a store node: the object is in the pool at the returned offset until
    /// [`EmbeddedStore::close`].
    pub(crate) fn open_in_pool(&self, key: &[u8]) -> Result<PoolRead> {
        let o = self.open(key, true)?;
        match o.source {
            Source::Pool(offset) => {
                Ok(PoolRead { ticket: o.ticket, offset, len: o.len, meta: o.meta })
            }
            Source::File => {
                self.close(o.ticket, key);
                Err(StoreError::Internal(
                    "an in-pool read found the object in the spill tier".into(),
                ))
            }
        }
    }

    /// Closes a read.
    pub(crate) fn close(&self, ticket: u64, key: &[u8]) {
        let _ = self.run(|st| {
            st.close(ticket, key);
            Ok(Step::Done(()))
        });
    }

    /// Sweeps expired puts, reads and leased objects now (a node calls this periodically).
    pub fn expire(&self) {
        let _ = self.run(|_| Ok(Step::Done(())));
    }

    /// Up to `limit` objects (at most [`crate::rpc::MAX_LIST`]) with keys after `after`, in key
    /// order: start with an empty `after`, then pass the last key of each page.
    pub fn list(&self, after: &[u8], limit: usize) -> Vec<ObjectInfo> {
        let limit = limit.min(crate::rpc::MAX_LIST);
        self.state.lock().list(after, limit, Instant::now())
    }

    /// Publishes the pool's levels (objects, bytes, pinned, spilled) through the `metrics`
    /// facade; a node does every second.
    pub fn publish_metrics(&self) {
        self.state.lock().publish_metrics();
    }

    /// Copies an open read's bytes into `dst` (exactly the object's length).
    fn read_out(&self, key: &[u8], o: &Opened, dst: &MemSlice) -> Result<()> {
        match o.source {
            Source::Pool(off) => Ok(dst.copy_from(&self.pool.slice(off, o.len)?)?),
            Source::File => {
                let spill = self.spill.as_ref().ok_or_else(|| StoreError::not_found(key))?;
                spill.read_into(o.id, key, dst).map(drop)
            }
        }
    }

    /// A put of `len` bytes that `fill` writes into the reserved pool block.
    fn put_with(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        r: Retention,
        fill: impl FnOnce(&MemSlice) -> tensorwire_core::Result<()>,
    ) -> Result<()> {
        let res = self.reserve(key, meta, len, r)?;
        match self.pool.slice(res.off, len).and_then(|block| fill(&block)) {
            Ok(()) => self.commit(res.ticket),
            Err(e) => {
                self.abort(res.ticket);
                Err(e.into())
            }
        }
    }

    /// A get into `dst`: open, copy, close.
    fn get_slice(
        &self,
        key: &[u8],
        dst: impl FnOnce(u64) -> Result<MemSlice>,
    ) -> Result<(TensorMeta, u64)> {
        let o = self.open(key, false)?;
        let r = dst(o.len).and_then(|d| self.read_out(key, &o, &d));
        self.close(o.ticket, key);
        r.map(|()| (o.meta, o.len))
    }
}

impl EmbeddedStore {
    /// A clean shutdown of a persistent store ([`StoreConfig::persist`]): writes every object
    /// still in the pool to the spill tier (pinned ones first) and returns how many it wrote.
    /// The store stays usable (reads load them back). Without `persist` it does nothing.
    pub fn shutdown(&self) -> Result<usize> {
        if !self.cfg.persist {
            return Ok(0);
        }
        let (n, io) = {
            let mut st = self.lock();
            (st.spill_all(), st.take_io())
        };
        self.carry_out(io)?;
        Ok(n)
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        if self.cfg.persist {
            return; // the files are the store's state across restarts
        }
        if let Some(spill) = &self.spill {
            for id in self.state.lock().files() {
                spill.remove(id);
            }
        }
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn put(&self, key: &[u8], meta: &TensorMeta, bytes: &[u8], r: Retention) -> Result<()> {
        self.put_with(key, meta, bytes.len() as u64, r, |block| block.write_at(0, bytes))
    }

    async fn put_from(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &MemSlice,
        r: Retention,
    ) -> Result<()> {
        self.put_with(key, meta, src.len(), r, |block| block.copy_from(src))
    }

    async fn get(&self, key: &[u8]) -> Result<(TensorMeta, Vec<u8>)> {
        let o = self.open(key, false)?;
        let r = (|| {
            let n = usize::try_from(o.len)
                .map_err(|_| StoreError::Internal("an object larger than memory".into()))?;
            let mut out = vec![0u8; n];
            match o.source {
                Source::Pool(off) => self.pool.slice(off, o.len)?.read_at(0, &mut out)?,
                Source::File => {
                    let spill = self.spill.as_ref().ok_or_else(|| StoreError::not_found(key))?;
                    spill.read(o.id, key, &mut out)?;
                }
            }
            Ok(out)
        })();
        self.close(o.ticket, key);
        r.map(|out| (o.meta, out))
    }

    async fn get_into(&self, key: &[u8], dst: &Region, offset: u64) -> Result<(TensorMeta, u64)> {
        self.get_slice(key, |len| Ok(dst.slice(offset, len)?))
    }

    async fn exists(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.run(|st| Ok(Step::Done(st.exists(key))))
    }

    async fn meta(&self, key: &[u8]) -> Result<TensorMeta> {
        let o = self.open(key, false)?;
        self.close(o.ticket, key);
        Ok(o.meta)
    }

    async fn remove(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.run(|st| Ok(Step::Done(st.remove(key))))
    }

    async fn pin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.run(|st| st.pin(key, true).map(Step::Done))
    }

    async fn unpin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.run(|st| st.pin(key, false).map(Step::Done))
    }

    async fn stats(&self) -> Result<StoreStats> {
        self.run(|st| Ok(Step::Done(st.stats())))
    }

    async fn set_lease(&self, key: &[u8], consumers: u32, ttl: Option<Duration>) -> Result<()> {
        check_key(key)?;
        let expires = ttl.map(deadline);
        self.run(|st| st.set_lease(key, consumers, expires).map(Step::Done))
    }

    async fn consumed(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        self.run(|st| st.consumed(key).map(Step::Done))
    }
}
