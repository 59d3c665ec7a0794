//! A software NIC: the verbs seam implemented in this process, so the backend's whole logic (QP
//! setup, leases, striping, failover, fallback) runs and is tested on machines without RDMA.
//!
//! It does what a NIC does, in the same order and with the same checks:
//! - a [`SoftFabric`] is the network: NICs on one fabric reach each other by GID;
//! - each [`SoftNic`] has one protection domain: a table of MRs by key, and QPs by number;
//! - a QP executes its work requests in order (reliable connected), on the NIC's own DMA
//!   threads, and completes each with a status; an error moves the QP to ERROR and flushes what
//!   follows;
//! - a request's remote side is checked as a responder NIC checks it: the peer QP is connected
//!   back to this one, the rkey names an MR of that NIC, the range lies inside it and the MR
//!   grants the access; local entries are checked against local MRs (a READ needs local write);
//! - dropping an MR waits for the copies using it, and a key whose MR is gone is refused.
//!
//! Faults are injected per NIC ([`SoftNic::fail_next`], [`SoftNic::break_qps`],
//! [`SoftNic::vanish`] and [`SoftNic::restore`], [`SoftNic::set_delay`]); counters say what it
//! did ([`SoftNic::counters`]).

mod dma;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock, Weak};
use std::time::Duration;
use tensorwire_core::backend::kit::lock;

use crate::verbs::{
    Cq, Keep, LinkLayer, Mr, MrAccess, Nic, NicAddress, NicInfo, Provider, Qp, QpCaps, VResult,
    VerbsError, Wc, WcStatus,
};

pub(crate) use dma::SoftQp;

static NEXT_FABRIC: AtomicU64 = AtomicU64::new(1);
static GLOBAL: LazyLock<SoftFabric> = LazyLock::new(SoftFabric::new);

/// A network of software NICs in this process. Cheap to clone (a handle).
#[derive(Debug, Clone)]
pub struct SoftFabric {
    inner: Arc<FabricInner>,
}

#[derive(Debug)]
struct FabricInner {
    id: u64,
    nics: Mutex<HashMap<[u8; 16], Weak<NicShared>>>,
    next_nic: AtomicU32,
}

impl Default for SoftFabric {
    fn default() -> Self {
        SoftFabric::new()
    }
}

impl SoftFabric {
    /// A new, empty fabric (NICs on other fabrics cannot reach its NICs).
    pub fn new() -> SoftFabric {
        SoftFabric {
            inner: Arc::new(FabricInner {
                id: NEXT_FABRIC.fetch_add(1, Ordering::Relaxed) | (0x50f7 << 48),
                nics: Mutex::new(HashMap::new()),
                next_nic: AtomicU32::new(0),
            }),
        }
    }

    /// The process's default fabric.
    pub fn global() -> SoftFabric {
        GLOBAL.clone()
    }

    /// Its id (the `fabric` of its NICs' [`NicInfo`]).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// A new NIC on this fabric.
    pub fn nic(&self, spec: SoftNicSpec) -> Arc<SoftNic> {
        let n = self.inner.next_nic.fetch_add(1, Ordering::Relaxed);
        let mut gid = [0u8; 16];
        gid[..8].copy_from_slice(&self.inner.id.to_be_bytes());
        gid[8..12].copy_from_slice(&std::process::id().to_be_bytes());
        gid[12..].copy_from_slice(&n.to_be_bytes());
        let info = NicInfo {
            address: NicAddress {
                name: spec.name.clone().unwrap_or_else(|| format!("softnic{n}")),
                port: 1,
                lid: (n as u16).wrapping_add(1),
                gid,
                gid_index: 0,
                link: LinkLayer::Ethernet,
                mtu: 5,
                fabric: self.inner.id,
            },
            numa_node: spec.numa_node,
            pci_path: spec.pci_path.clone(),
            active: true,
        };
        let shared = Arc::new(NicShared {
            info,
            fabric: self.inner.clone(),
            mrs: RwLock::new(HashMap::new()),
            qps: Mutex::new(HashMap::new()),
            sched: Arc::new(dma::Sched::new(spec.spin)),
            gone: AtomicBool::new(false),
            faults: Mutex::new(Faults::default()),
            next_key: AtomicU32::new(0x1000),
            next_qpn: AtomicU32::new(0x100),
            retry_delay: spec.retry_delay,
            counters: Counters::default(),
        });
        lock(&self.inner.nics).insert(gid, Arc::downgrade(&shared));
        for t in 0..spec.threads.max(1) {
            let sched = shared.sched.clone();
            let name = format!("tw-{}-dma{t}", shared.info.address.name);
            if let Err(e) = std::thread::Builder::new().name(name).spawn(move || dma::run(sched)) {
                tracing::error!(error = %e, "softnic: cannot start a DMA thread");
            }
        }
        Arc::new(SoftNic { shared })
    }
}

fn find(fabric: &FabricInner, gid: &[u8; 16]) -> Option<Arc<NicShared>> {
    let nic = lock(&fabric.nics).get(gid).and_then(Weak::upgrade)?;
    (!nic.gone.load(Ordering::Acquire)).then_some(nic)
}

/// How to make a software NIC.
#[derive(Debug, Clone)]
pub struct SoftNicSpec {
    /// Device name (default `softnicN`).
    pub name: Option<String>,
    /// NUMA node it claims to be attached to.
    pub numa_node: Option<u32>,
    /// PCI path it claims (for PCIe distance tests).
    pub pci_path: Option<String>,
    /// DMA threads (QPs run in parallel on them, each QP on one at a time).
    pub threads: usize,
    /// How long a request to an unreachable peer takes to fail (the transport's retries).
    pub retry_delay: Duration,
    /// How long an idle DMA thread spins for new requests before it sleeps (zero: it sleeps at
    /// once). A spin keeps the software NIC's own wake-up out of per-op latency figures, at the
    /// cost of that much CPU per idle moment.
    pub spin: Duration,
}

impl Default for SoftNicSpec {
    fn default() -> Self {
        SoftNicSpec {
            name: None,
            numa_node: None,
            pci_path: None,
            threads: 1,
            retry_delay: Duration::from_millis(20),
            spin: Duration::ZERO,
        }
    }
}

/// What a software NIC did, counted.
#[derive(Debug, Default)]
struct Counters {
    wrs: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

/// A snapshot of a software NIC's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SoftCounters {
    /// Work requests executed (successfully or not).
    pub wrs: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Work requests that completed in error (flushes excluded).
    pub errors: u64,
}

/// Injected faults, consumed as requests run.
#[derive(Debug, Default)]
struct Faults {
    /// The next requests complete with these statuses, in order.
    fail: std::collections::VecDeque<WcStatus>,
    /// Every request waits this long before it completes.
    delay: Duration,
}

/// An MR of a software NIC: the memory it covers, what it grants, and a lock that copies hold
/// shared and deregistration takes exclusive.
#[derive(Debug)]
pub(crate) struct MrInner {
    key: u32,
    addr: usize,
    len: u64,
    access: MrAccess,
    inuse: RwLock<()>,
    _keep: Option<Keep>,
    /// A dma-buf mapping made at registration, unmapped with the MR.
    mapping: Option<(usize, usize)>,
}

impl Drop for MrInner {
    fn drop(&mut self) {
        if let Some((addr, len)) = self.mapping {
            // SAFETY: exactly the mapping `reg_dmabuf_mr` made; no copy holds the MR any more
            // (copies hold an `Arc` of it).
            unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        }
    }
}

/// The NIC's state, shared by its handle, its MRs, QPs and DMA threads.
#[derive(Debug)]
pub(crate) struct NicShared {
    info: NicInfo,
    fabric: Arc<FabricInner>,
    mrs: RwLock<HashMap<u32, Arc<MrInner>>>,
    qps: Mutex<HashMap<u32, Weak<dma::QpShared>>>,
    sched: Arc<dma::Sched>,
    gone: AtomicBool,
    faults: Mutex<Faults>,
    next_key: AtomicU32,
    next_qpn: AtomicU32,
    retry_delay: Duration,
    counters: Counters,
}

impl NicShared {
    fn ensure_present(&self, call: &'static str) -> VResult<()> {
        if self.gone.load(Ordering::Acquire) {
            return Err(VerbsError::new(
                call,
                format!("{}: device removed (ENODEV)", self.info.address.name),
            ));
        }
        Ok(())
    }

    fn mr(&self, key: u32) -> Option<Arc<MrInner>> {
        self.mrs.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key).cloned()
    }

    fn qps(&self) -> Vec<Arc<dma::QpShared>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }
}

impl Drop for NicShared {
    fn drop(&mut self) {
        lock(&self.fabric.nics).remove(&self.info.address.gid);
        self.sched.stop();
    }
}

/// A software NIC (see the module docs).
#[derive(Debug)]
pub struct SoftNic {
    shared: Arc<NicShared>,
}

impl SoftNic {
    /// The next `n` requests this NIC executes complete with `status` (and, as on a real NIC,
    /// move their QP to ERROR).
    pub fn fail_next(&self, n: usize, status: WcStatus) {
        lock(&self.shared.faults).fail.extend(std::iter::repeat_n(status, n));
    }

    /// Moves every QP of this NIC to ERROR (as a link flap or a fatal async event does).
    pub fn break_qps(&self) {
        for qp in self.shared.qps() {
            qp.to_error();
        }
    }

    /// The NIC disappears (hot unplug, a dead port): its QPs go to ERROR, nothing new can be
    /// made on it, and peers' requests to it fail with `RetryExceeded`.
    pub fn vanish(&self) {
        self.shared.gone.store(true, Ordering::Release);
        self.break_qps();
    }

    /// The NIC is back (new QPs and MRs work again; old QPs stay in ERROR).
    pub fn restore(&self) {
        self.shared.gone.store(false, Ordering::Release);
    }

    /// Every request waits `d` before it completes (a slow or congested NIC).
    pub fn set_delay(&self, d: Duration) {
        lock(&self.shared.faults).delay = d;
    }

    /// What it did so far.
    pub fn counters(&self) -> SoftCounters {
        let c = &self.shared.counters;
        SoftCounters {
            wrs: c.wrs.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
        }
    }

    /// MRs registered now.
    pub fn mr_count(&self) -> usize {
        self.shared.mrs.read().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    fn insert_mr(
        &self,
        addr: usize,
        len: u64,
        access: MrAccess,
        keep: Option<Keep>,
        mapping: Option<(usize, usize)>,
    ) -> Box<dyn Mr> {
        let key = self.shared.next_key.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(MrInner {
            key,
            addr,
            len,
            access,
            inuse: RwLock::new(()),
            _keep: keep,
            mapping,
        });
        self.shared
            .mrs
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key, inner.clone());
        Box::new(SoftMr { nic: self.shared.clone(), inner })
    }
}

impl Nic for SoftNic {
    fn info(&self) -> &NicInfo {
        &self.shared.info
    }

    unsafe fn reg_mr(
        &self,
        addr: usize,
        len: u64,
        access: MrAccess,
        keep: Option<Keep>,
    ) -> VResult<Box<dyn Mr>> {
        self.shared.ensure_present("ibv_reg_mr")?;
        if addr.checked_add(len as usize).is_none() {
            return Err(VerbsError::new("ibv_reg_mr", "range wraps the address space (EINVAL)"));
        }
        Ok(self.insert_mr(addr, len, access, keep, None))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        fd: RawFd,
        offset: u64,
        len: u64,
        access: MrAccess,
    ) -> VResult<Box<dyn Mr>> {
        self.shared.ensure_present("ibv_reg_dmabuf_mr")?;
        let total = offset
            .checked_add(len)
            .and_then(|t| usize::try_from(t).ok())
            .filter(|&t| t > 0)
            .ok_or_else(|| VerbsError::new("ibv_reg_dmabuf_mr", "empty or oversized range"))?;
        // The software NIC reaches a dma-buf the way a kernel driver does: through a mapping of
        // the buffer (in tests, a memfd stands in for a GPU's export).
        // SAFETY: mapping `total` bytes of a caller-provided descriptor (this function's
        // contract); the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(VerbsError::last_os("ibv_reg_dmabuf_mr"));
        }
        let base = ptr as usize;
        Ok(self.insert_mr(base + offset as usize, len, access, None, Some((base, total))))
    }

    unsafe fn reg_device_mr(&self, _addr: u64, _len: u64, _a: MrAccess) -> VResult<Box<dyn Mr>> {
        Err(VerbsError::new(
            "ibv_reg_mr",
            "the software NIC reaches device memory only through a dma-buf (EOPNOTSUPP)",
        ))
    }

    fn peer_memory(&self) -> bool {
        false
    }

    fn create_cq(&self, depth: u32) -> VResult<Arc<dyn Cq>> {
        self.shared.ensure_present("ibv_create_cq")?;
        Ok(Arc::new(SoftCq::new(depth)?))
    }

    fn create_qp(&self, cq: &Arc<dyn Cq>, caps: QpCaps) -> VResult<Arc<dyn Qp>> {
        self.shared.ensure_present("ibv_create_qp")?;
        let cq = cq.clone();
        let soft = SoftCq::downcast(&cq)
            .ok_or_else(|| VerbsError::new("ibv_create_qp", "a CQ of another device"))?;
        let qp = SoftQp::new(&self.shared, soft, caps);
        Ok(Arc::new(qp))
    }
}

/// An MR's handle; dropping it deregisters the MR once no copy uses it.
#[derive(Debug)]
struct SoftMr {
    nic: Arc<NicShared>,
    inner: Arc<MrInner>,
}

impl Mr for SoftMr {
    fn lkey(&self) -> u32 {
        self.inner.key
    }
    fn rkey(&self) -> u32 {
        self.inner.key
    }
    fn base(&self) -> u64 {
        self.inner.addr as u64
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        self.nic
            .mrs
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.inner.key);
        // Wait for copies in progress: once this returns, the NIC touches the memory no more.
        drop(self.inner.inuse.write().unwrap_or_else(std::sync::PoisonError::into_inner));
    }
}

/// A completion queue: completions in order, and an eventfd as its completion channel.
#[derive(Debug)]
pub(crate) struct SoftCq {
    queue: Mutex<std::collections::VecDeque<Wc>>,
    armed: AtomicBool,
    fd: OwnedFd,
    depth: usize,
    overflowed: AtomicBool,
}

impl SoftCq {
    fn new(depth: u32) -> VResult<SoftCq> {
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(VerbsError::last_os("ibv_create_comp_channel"));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(SoftCq {
            queue: Mutex::new(std::collections::VecDeque::new()),
            armed: AtomicBool::new(false),
            fd,
            depth: depth.max(1) as usize,
            overflowed: AtomicBool::new(false),
        })
    }

    fn downcast(cq: &Arc<dyn Cq>) -> Option<Arc<SoftCq>> {
        let any: Arc<dyn std::any::Any + Send + Sync> = cq.clone().as_any();
        any.downcast::<SoftCq>().ok()
    }

    /// Adds a completion and signals the channel if armed.
    fn push(&self, wc: Wc) {
        {
            let mut q = lock(&self.queue);
            if q.len() >= self.depth {
                // A real CQ overruns into an async error; the backend sizes CQs so this
                // never happens, and says so loudly if it does.
                self.overflowed.store(true, Ordering::Release);
                tracing::error!(depth = self.depth, "softnic: completion queue overrun");
            }
            q.push_back(wc);
        }
        if self.armed.swap(false, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live value to our eventfd (EAGAIN on a full counter
            // only means it is already readable).
            unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
        }
    }
}

impl Cq for SoftCq {
    fn event_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn arm(&self) -> VResult<()> {
        self.armed.store(true, Ordering::Release);
        Ok(())
    }

    fn take_events(&self) -> VResult<u32> {
        let mut n: u64 = 0;
        // SAFETY: reads 8 bytes into a live value from our non-blocking eventfd.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut n).cast(), 8) };
        Ok(if r == 8 { n.min(u64::from(u32::MAX)) as u32 } else { 0 })
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> VResult<usize> {
        let mut q = lock(&self.queue);
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        Ok(n)
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// Software NICs as a [`Provider`]: the ones it was made with.
#[derive(Debug)]
pub struct SoftProvider {
    nics: Vec<Arc<SoftNic>>,
}

impl SoftProvider {
    /// `count` NICs on `fabric`, each made from `spec`.
    pub fn new(fabric: &SoftFabric, count: usize, spec: SoftNicSpec) -> Arc<SoftProvider> {
        Self::with(fabric, (0..count).map(|_| spec.clone()))
    }

    /// One NIC on `fabric` per spec (e.g. NICs on different NUMA nodes).
    pub fn with(
        fabric: &SoftFabric,
        specs: impl IntoIterator<Item = SoftNicSpec>,
    ) -> Arc<SoftProvider> {
        Arc::new(SoftProvider { nics: specs.into_iter().map(|s| fabric.nic(s)).collect() })
    }

    /// Its NICs (to inject faults and read counters).
    pub fn nics(&self) -> &[Arc<SoftNic>] {
        &self.nics
    }
}

impl Provider for SoftProvider {
    fn name(&self) -> &'static str {
        "softnic"
    }

    fn open_all(&self) -> VResult<Vec<Arc<dyn Nic>>> {
        Ok(self.nics.iter().map(|n| n.clone() as Arc<dyn Nic>).collect())
    }
}

#[cfg(test)]
mod tests;
