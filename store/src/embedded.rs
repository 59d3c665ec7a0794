//! The embedded store: a pool region registered with the local engine, managed by [`PoolState`],
//! with an optional file spill tier. Copies between caller regions and the pool are one
//! `copy_bytes` each (streaming stores for large objects); nothing else touches the bytes.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tensorwire_core::copy::copy_bytes;
use tensorwire_core::sync::lock;
use tensorwire_core::{Engine, Error, Permissions, Region, RemoteRegion, Result, TensorMeta};

use crate::api::{Retention, Store, StoreStats, check_key, check_meta, check_range, missing};
use crate::spill::Spill;
use crate::state::{Evictor, Loc, Marks, Opened, PoolState, Reserved, Victim, deadline};

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
    /// Let peers of the engine read and write the pool (needed to serve it as a store node).
    pub shared: bool,
    /// A reserved put not committed within this time is dropped (a client that died mid-put).
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

/// A store living in this process.
#[derive(Debug)]
pub struct EmbeddedStore {
    pool: Region,
    state: Mutex<PoolState>,
    spill: Option<Spill>,
    cfg: StoreConfig,
}

impl EmbeddedStore {
    /// Allocates the pool from `engine` and starts empty.
    pub async fn new(engine: &Engine, cfg: StoreConfig) -> Result<Arc<EmbeddedStore>> {
        if !(0.0..=1.0).contains(&cfg.low_watermark)
            || !(cfg.low_watermark..=1.0).contains(&cfg.high_watermark)
        {
            return Err(Error::InvalidArgument(format!(
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
        Ok(Arc::new(EmbeddedStore {
            pool,
            state: Mutex::new(PoolState::new(cap, marks)),
            spill,
            cfg,
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

    /// The state, with expired puts, reads and leased objects swept first.
    fn locked(&self) -> std::sync::MutexGuard<'_, PoolState> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        st.expire(now);
        let gone = st.expire_objects(now);
        self.drop_spilled(&gone);
        st
    }

    fn drop_spilled(&self, gone: &[crate::state::Obj]) {
        if let Some(spill) = &self.spill {
            for o in gone.iter().filter(|o| o.loc == Loc::Spilled) {
                spill.remove(o.id);
            }
        }
    }

    fn base(&self) -> usize {
        self.pool.as_ptr() as usize
    }

    /// Runs `f` on the state with an evictor that spills (or drops) victims. Expired puts and reads
    /// are swept first.
    fn with_state<T>(
        &self,
        f: impl FnOnce(&mut PoolState, &mut Evictor<'_>) -> Result<T>,
    ) -> Result<T> {
        let base = self.base();
        let spill = self.spill.as_ref();
        let mut evict = |v: &Victim<'_>| -> Result<bool> {
            let Some(spill) = spill else { return Ok(false) };
            let Loc::Pool { block, .. } = v.obj.loc else { return Ok(false) };
            // SAFETY: the victim's block lies inside the pool region (the allocator only hands out
            // blocks inside it) and nobody writes it: it has no readers and we hold the state lock.
            unsafe {
                spill.write(v.obj.id, v.key, &v.obj.meta, base + v.off as usize, v.obj.len, block)
            }?;
            Ok(true)
        };
        let run = || {
            let mut st = lock(&self.state);
            st.expire(Instant::now());
            f(&mut st, &mut evict)
        };
        // Spill writes are blocking file I/O: keep them off the async workers' critical path.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
            _ => run(),
        }
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

    /// Reserves pool space for a put; returns its ticket and pool offset.
    pub(crate) fn reserve(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        len: u64,
        r: Retention,
    ) -> Result<Reserved> {
        check_key(key)?;
        check_meta(meta, len)?;
        let ttl = deadline(self.cfg.put_ttl);
        self.with_state(|st, ev| st.reserve(key, meta, len, r, ttl, ev))
    }

    /// Publishes a reserved put.
    pub(crate) fn commit(&self, ticket: u64) -> Result<()> {
        self.with_state(|st, ev| st.commit(ticket, ev))
    }

    /// Drops a reserved put.
    pub(crate) fn abort(&self, ticket: u64) {
        lock(&self.state).abort(ticket);
    }

    /// Opens a read; with `in_pool`, a spilled object is loaded back into the pool first (a remote
    /// reader reads it from there), and the returned offset is valid.
    pub(crate) fn open(&self, key: &[u8], in_pool: bool) -> Result<(Opened, Option<u64>)> {
        check_key(key)?;
        let ttl = deadline(self.cfg.read_ttl);
        let opened = self.with_state(|st, _| st.open_read(key, ttl))?;
        match opened.loc {
            Loc::Pool { off, .. } => Ok((opened, Some(off))),
            Loc::Spilled if !in_pool => Ok((opened, None)),
            Loc::Spilled => match self.reload(key, &opened) {
                Ok(off) => Ok((opened, Some(off))),
                Err(e) => {
                    self.close(opened.ticket);
                    Err(e)
                }
            },
        }
    }

    fn reload(&self, key: &[u8], o: &Opened) -> Result<u64> {
        let spill = self.spill.as_ref().ok_or_else(|| missing(key))?;
        let base = self.base();
        self.with_state(|st, ev| {
            let off = st.reload(key, ev)?;
            // SAFETY: the new block lies inside the pool and belongs to this object, which has a
            // reader (us), so nothing else uses it; we hold the state lock.
            match unsafe { spill.read_into(o.id, key, base + off as usize, o.len) } {
                Ok(_) => {
                    spill.remove(o.id);
                    Ok(off)
                }
                Err(e) => {
                    st.unload(key); // a corrupt or truncated file is never served
                    Err(e)
                }
            }
        })
    }

    /// Closes a read.
    pub(crate) fn close(&self, ticket: u64) {
        lock(&self.state).close_read(ticket);
    }

    /// Sweeps expired puts, reads and leased objects now (a node calls this periodically).
    pub fn expire(&self) {
        drop(self.locked());
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        if let Some(spill) = &self.spill {
            for id in lock(&self.state).spilled_ids() {
                spill.remove(id);
            }
        }
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn put(&self, key: &[u8], meta: &TensorMeta, bytes: &[u8], r: Retention) -> Result<()> {
        let len = bytes.len() as u64;
        let res = self.reserve(key, meta, len, r)?;
        // SAFETY: the reserved block holds `len` bytes inside the pool and is ours until commit.
        unsafe { copy_bytes(bytes.as_ptr() as usize, self.base() + res.off as usize, bytes.len()) };
        self.commit(res.ticket)
    }

    async fn put_from(
        &self,
        key: &[u8],
        meta: &TensorMeta,
        src: &Region,
        offset: u64,
        len: u64,
        r: Retention,
    ) -> Result<()> {
        let from = check_range(src, offset, len, "source")?;
        let res = self.reserve(key, meta, len, r)?;
        // SAFETY: `from` is `len` bytes inside the caller's live region (checked above, and the
        // borrow keeps it registered); the reserved block is ours until commit.
        unsafe { copy_bytes(from, self.base() + res.off as usize, len as usize) };
        self.commit(res.ticket)
    }

    async fn get(&self, key: &[u8]) -> Result<(TensorMeta, Vec<u8>)> {
        let (o, off) = self.open(key, false)?;
        let mut out = vec![0u8; o.len as usize];
        let r = match off {
            Some(off) => {
                // SAFETY: the object's block holds `len` bytes and cannot be reused while our read
                // is open; `out` holds `len` bytes.
                unsafe {
                    copy_bytes(self.base() + off as usize, out.as_mut_ptr() as usize, out.len())
                };
                Ok(())
            }
            None => self.spill_read(key, &o, out.as_mut_ptr() as usize),
        };
        self.close(o.ticket);
        r.map(|()| (o.meta, out))
    }

    async fn get_into(&self, key: &[u8], dst: &Region, offset: u64) -> Result<(TensorMeta, u64)> {
        let (o, off) = self.open(key, false)?;
        let r = check_range(dst, offset, o.len, "destination").and_then(|to| match off {
            Some(off) => {
                // SAFETY: source block as in `get`; `to` is `len` bytes inside the live `dst`.
                unsafe { copy_bytes(self.base() + off as usize, to, o.len as usize) };
                Ok(())
            }
            None => self.spill_read(key, &o, to),
        });
        self.close(o.ticket);
        r.map(|()| (o.meta, o.len))
    }

    async fn exists(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        Ok(self.locked().exists(key))
    }

    async fn remove(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let removed = self.locked().remove(key);
        if let (Some(o), Some(spill)) = (&removed, &self.spill) {
            if o.loc == Loc::Spilled {
                spill.remove(o.id);
            }
        }
        Ok(removed.is_some())
    }

    async fn pin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.locked().pin(key, true)
    }

    async fn unpin(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.locked().pin(key, false)
    }

    async fn stats(&self) -> Result<StoreStats> {
        Ok(self.locked().stats())
    }

    async fn set_lease(&self, key: &[u8], consumers: u32, ttl: Option<Duration>) -> Result<()> {
        check_key(key)?;
        self.locked().set_lease(key, consumers, ttl.map(deadline))
    }

    async fn consumed(&self, key: &[u8]) -> Result<bool> {
        check_key(key)?;
        let gone = self.locked().consumed(key)?;
        let removed = gone.is_some();
        self.drop_spilled(&gone.into_iter().collect::<Vec<_>>());
        Ok(removed)
    }
}

impl EmbeddedStore {
    /// Reads a spilled object straight into `to` (`o.len` writable bytes).
    fn spill_read(&self, key: &[u8], o: &Opened, to: usize) -> Result<()> {
        let spill = self.spill.as_ref().ok_or_else(|| missing(key))?;
        // SAFETY: callers pass `o.len` writable bytes at `to`.
        unsafe { spill.read_into(o.id, key, to, o.len) }.map(drop)
    }

    /// The spill file of `key`, if it is spilled (tests corrupt it).
    pub fn spill_file(&self, key: &[u8]) -> Option<PathBuf> {
        let spill = self.spill.as_ref()?;
        let st = lock(&self.state);
        let id = st.spilled_id(key)?;
        Some(spill.file(id))
    }
}
