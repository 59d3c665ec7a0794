//! The verbs seam over libibverbs, through `sideway` (loaded at run time by its
//! `rdma-mummy-sys`, so a host without libibverbs or without devices sees no NICs rather than a
//! link error). Completion-channel events and CQ arming, which `sideway` does not wrap, call
//! `rdma-mummy-sys` directly.
//!
//! Built behind the `verbs` feature; this machine has no RDMA device, so this file is compiled
//! in CI and exercised only on hosts with one (see `tests/it/hardware.rs`).

use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tensorwire_core::backend::kit::lock;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue as _, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer as IbvLink, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard as _, QueuePair as _, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry as _, WorkRequestFlags,
};

use crate::affinity;
use crate::verbs::{
    Cq, Keep, LinkLayer, Mr, MrAccess, Nic, NicAddress, NicInfo, Provider, Qp, QpAddress, QpCaps,
    QpState, QpTiming, VResult, VerbsError, Wc, WcStatus, Wr, WrOp,
};

fn err(call: &'static str, e: impl std::fmt::Display) -> VerbsError {
    VerbsError::new(call, e.to_string())
}

/// libibverbs as a [`Provider`]: every port of every device, opened.
#[derive(Debug)]
pub(crate) struct Ibverbs {
    sysfs: PathBuf,
}

impl Ibverbs {
    pub(crate) fn new(sysfs: PathBuf) -> Ibverbs {
        Ibverbs { sysfs }
    }
}

impl Provider for Ibverbs {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn open_all(&self) -> VResult<Vec<Arc<dyn Nic>>> {
        let list = match DeviceList::new() {
            Ok(l) => l,
            // No device (ENOSYS without a kernel driver, or no libibverbs at all): no NICs.
            Err(e) => {
                tracing::debug!(error = %e, "rdma: no RDMA devices");
                return Ok(Vec::new());
            }
        };
        let mut nics: Vec<Arc<dyn Nic>> = Vec::new();
        for dev in list.iter() {
            let name = dev.name();
            let ctx = match dev.open() {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(device = %name, error = %e, "rdma: cannot open device");
                    continue;
                }
            };
            let ports = ctx.query_device().map(|d| d.phys_port_cnt()).unwrap_or(1);
            for port in 1..=ports {
                match IbvNic::open(&ctx, &name, port, &self.sysfs) {
                    Ok(n) => nics.push(Arc::new(n)),
                    Err(e) => {
                        tracing::warn!(device = %name, port, error = %e, "rdma: port unusable")
                    }
                }
            }
        }
        Ok(nics)
    }
}

/// One port of a device: its context and a protection domain.
#[derive(Debug)]
struct IbvNic {
    info: NicInfo,
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
}

fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

fn mtu_of(code: u8) -> Mtu {
    match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// Whether a GPU peer-memory client is loaded (`nvidia-peermem`, or the older `nv_peer_mem`).
fn peer_memory_loaded() -> bool {
    ["/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem", "/sys/kernel/mm/memory_peers/nv_mem"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

/// RoCE v2 in the kernel's GID types.
const GID_TYPE_ROCE_V2: u32 = 2;

impl IbvNic {
    fn open(
        ctx: &Arc<DeviceContext>,
        name: &str,
        port: u8,
        sysfs: &std::path::Path,
    ) -> VResult<Self> {
        let attr = ctx.query_port(port).map_err(|e| err("ibv_query_port", e))?;
        let link = match attr.link_layer() {
            IbvLink::Ethernet => LinkLayer::Ethernet,
            _ => LinkLayer::Infiniband,
        };
        // RoCE: the first RoCE v2 GID with an address; InfiniBand: index 0.
        let mut gid_index = 0u32;
        if link == LinkLayer::Ethernet {
            for i in 0..attr.gid_tbl_len().max(0) as u32 {
                let (Ok(g), Ok(t)) = (ctx.query_gid(port, i), ctx.query_gid_type(port, i)) else {
                    continue;
                };
                if t == GID_TYPE_ROCE_V2 && !g.is_zero() {
                    gid_index = i;
                    break;
                }
            }
        }
        let gid = ctx.query_gid(port, gid_index).map_err(|e| err("ibv_query_gid", e))?;
        let pd = ctx.alloc_pd().map_err(|e| err("ibv_alloc_pd", e))?;
        let (numa_node, pci_path) = affinity::nic_topology(sysfs, name);
        let fabric = match link {
            LinkLayer::Infiniband => u64::from_be_bytes(gid.raw[..8].try_into().unwrap_or([0; 8])),
            LinkLayer::Ethernet => 0,
        };
        let info = NicInfo {
            address: NicAddress {
                name: if port == 1 { name.to_string() } else { format!("{name}:{port}") },
                port,
                lid: attr.lid(),
                gid: gid.raw,
                gid_index: gid_index as u8,
                link,
                mtu: mtu_code(attr.active_mtu()),
                fabric,
            },
            numa_node,
            pci_path,
            active: attr.port_state() == PortState::Active,
        };
        Ok(IbvNic { info, ctx: ctx.clone(), pd })
    }
}

fn access(a: MrAccess) -> AccessFlags {
    let mut f = AccessFlags::none();
    if a.local_write {
        f |= AccessFlags::LocalWrite;
    }
    if a.remote_read {
        f |= AccessFlags::RemoteRead;
    }
    if a.remote_write {
        f |= AccessFlags::RemoteWrite;
    }
    f
}

impl Nic for IbvNic {
    fn info(&self) -> &NicInfo {
        &self.info
    }

    unsafe fn reg_mr(
        &self,
        addr: usize,
        len: u64,
        acc: MrAccess,
        keep: Option<Keep>,
    ) -> VResult<Box<dyn Mr>> {
        let len = usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_mr", "too large"))?;
        // SAFETY: forwarded contract: the memory stays valid until the MR drops (or `keep`
        // keeps it); the NIC pins its pages.
        let mr =
            unsafe { self.pd.reg_mr(addr, len, access(acc)) }.map_err(|e| err("ibv_reg_mr", e))?;
        Ok(Box::new(IbvMr { mr, _keep: keep }))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        fd: RawFd,
        offset: u64,
        len: u64,
        acc: MrAccess,
    ) -> VResult<Box<dyn Mr>> {
        let len =
            usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_dmabuf_mr", "too large"))?;
        // SAFETY: forwarded contract (a dma-buf whose range stays valid while the MR lives); the
        // I/O virtual address is the offset, so work requests name offsets into the buffer.
        let mr = unsafe { self.pd.reg_dmabuf_mr(offset, len, offset, fd, access(acc)) }
            .map_err(|e| err("ibv_reg_dmabuf_mr", e))?;
        Ok(Box::new(IbvMr { mr, _keep: None }))
    }

    unsafe fn reg_device_mr(&self, addr: u64, len: u64, acc: MrAccess) -> VResult<Box<dyn Mr>> {
        if !self.peer_memory() {
            return Err(VerbsError::new("ibv_reg_mr", "no peer-memory client (nvidia-peermem)"));
        }
        let len = usize::try_from(len).map_err(|_| VerbsError::new("ibv_reg_mr", "too large"))?;
        // SAFETY: forwarded contract (device memory that stays allocated while the MR lives);
        // the peer-memory client pins the GPU pages, and nothing here dereferences them.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access(acc)) }
            .map_err(|e| err("ibv_reg_mr(device)", e))?;
        Ok(Box::new(IbvMr { mr, _keep: None }))
    }

    fn peer_memory(&self) -> bool {
        peer_memory_loaded()
    }

    fn create_cq(&self, depth: u32) -> VResult<Arc<dyn Cq>> {
        let channel =
            self.ctx.create_comp_channel().map_err(|e| err("ibv_create_comp_channel", e))?;
        channel.set_nonblocking(true).map_err(|e| err("fcntl(O_NONBLOCK)", e))?;
        let mut b = self.ctx.create_cq_builder();
        b.setup_cqe(depth.max(1)).setup_comp_channel(&channel, 0);
        let cq = b.build().map_err(|e| err("ibv_create_cq", e))?;
        Ok(Arc::new(IbvCq { cq, channel, polling: Mutex::new(()) }))
    }

    fn create_qp(&self, cq: &Arc<dyn Cq>, caps: QpCaps) -> VResult<Arc<dyn Qp>> {
        let ours = cq
            .clone()
            .as_any()
            .downcast::<IbvCq>()
            .map_err(|_| VerbsError::new("ibv_create_qp", "a CQ of another provider"))?;
        let mut b = self.pd.create_qp_builder();
        b.setup_max_send_wr(caps.max_send_wr)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(caps.max_sge)
            .setup_max_recv_sge(1)
            .setup_send_cq(ours.cq.clone())
            .setup_recv_cq(ours.cq.clone());
        let qp = b.build().map_err(|e| err("ibv_create_qp", e))?;
        Ok(Arc::new(IbvQp {
            qpn: qp.qp_number(),
            qp: Mutex::new(qp),
            port: self.info.address.port,
            gid_index: self.info.address.gid_index,
            link: self.info.address.link,
            _cq: ours,
        }))
    }
}

#[derive(Debug)]
struct IbvMr {
    mr: Arc<MemoryRegion>,
    _keep: Option<Keep>,
}

impl Mr for IbvMr {
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    fn base(&self) -> u64 {
        self.mr.get_ptr() as u64
    }
}

#[derive(Debug)]
struct IbvCq {
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    polling: Mutex<()>,
}

impl Cq for IbvCq {
    fn event_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }

    fn arm(&self) -> VResult<()> {
        // SAFETY: the CQ is live (held by `self`).
        let r = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if r != 0 {
            return Err(VerbsError::new(
                "ibv_req_notify_cq",
                std::io::Error::from_raw_os_error(r).to_string(),
            ));
        }
        Ok(())
    }

    fn take_events(&self) -> VResult<u32> {
        let mut n = 0u32;
        loop {
            let mut cq: *mut rdma_mummy_sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: a live, non-blocking completion channel; out-pointers to locals.
            let r = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut cq,
                    &mut ctx,
                )
            };
            if r != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledging events of our own live CQ.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(self.cq.cq().as_ptr(), n) };
        }
        Ok(n)
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> VResult<usize> {
        let _one = lock(&self.polling);
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(_) => return Ok(0),
        };
        let mut n = 0;
        for wc in poller.take(max) {
            out.push(Wc { id: wc.wr_id(), status: status(wc.status()) });
            n += 1;
        }
        Ok(n)
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

fn status(s: u32) -> WcStatus {
    match WorkCompletionStatus::from(s) {
        WorkCompletionStatus::Success => WcStatus::Success,
        WorkCompletionStatus::LocalLengthError => WcStatus::LocalLength,
        WorkCompletionStatus::LocalProtectionError => WcStatus::LocalProtection,
        WorkCompletionStatus::WorkRequestFlushedError => WcStatus::Flushed,
        WorkCompletionStatus::RemoteAccessError => WcStatus::RemoteAccess,
        WorkCompletionStatus::RemoteInvalidRequestError => WcStatus::RemoteInvalidRequest,
        WorkCompletionStatus::RemoteOperationError => WcStatus::RemoteOperation,
        WorkCompletionStatus::RetryCounterExceededError => WcStatus::RetryExceeded,
        WorkCompletionStatus::ResponderNotReadyRetryCounterExceededError => {
            WcStatus::RnrRetryExceeded
        }
        _ => WcStatus::Other(s),
    }
}

#[derive(Debug)]
struct IbvQp {
    qpn: u32,
    qp: Mutex<BasicQueuePair>,
    port: u8,
    gid_index: u8,
    link: LinkLayer,
    _cq: Arc<IbvCq>,
}

impl Qp for IbvQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn state(&self) -> QpState {
        match lock(&self.qp).state() {
            QueuePairState::Reset => QpState::Reset,
            QueuePairState::Init => QpState::Init,
            QueuePairState::ReadyToReceive => QpState::Rtr,
            QueuePairState::ReadyToSend => QpState::Rts,
            _ => QpState::Error,
        }
    }

    fn init(&self) -> VResult<()> {
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        lock(&self.qp).modify(&a).map_err(|e| err("ibv_modify_qp(INIT)", e))
    }

    fn connect(&self, psn: u32, remote: &QpAddress, t: &QpTiming) -> VResult<()> {
        let mut av = AddressHandleAttribute::new();
        av.setup_port(self.port).setup_dest_lid(remote.lid);
        if self.link == LinkLayer::Ethernet || remote.lid == 0 {
            av.setup_grh(&Gid { raw: remote.gid }, 0, self.gid_index, 64, 0);
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_of(remote.mtu))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(t.max_rd_atomic)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&av);
        let mut qp = lock(&self.qp);
        qp.modify(&rtr).map_err(|e| err("ibv_modify_qp(RTR)", e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(psn)
            .setup_timeout(t.timeout)
            .setup_retry_cnt(t.retry_count)
            .setup_rnr_retry(t.rnr_retry)
            .setup_max_read_atomic(t.max_rd_atomic);
        qp.modify(&rts).map_err(|e| err("ibv_modify_qp(RTS)", e))
    }

    fn to_error(&self) -> VResult<()> {
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Error);
        lock(&self.qp).modify(&a).map_err(|e| err("ibv_modify_qp(ERR)", e))
    }

    fn post(&self, wrs: &[Wr<'_>]) -> std::result::Result<(), (usize, VerbsError)> {
        let mut qp = lock(&self.qp);
        // One request per post: ibv_post_send stops at the first bad request and `sideway` does
        // not say which it was, and the count of requests that went must be exact.
        for (i, w) in wrs.iter().enumerate() {
            let mut guard = qp.start_post_send();
            let h = guard.construct_wr(w.id, WorkRequestFlags::Signaled);
            let h = match w.op {
                WrOp::Write => h.setup_write(w.rkey, w.remote_addr),
                WrOp::Read => h.setup_read(w.rkey, w.remote_addr),
            };
            let list: Vec<rdma_mummy_sys::ibv_sge> = w
                .sges
                .iter()
                .map(|s| rdma_mummy_sys::ibv_sge { addr: s.addr, length: s.len, lkey: s.lkey })
                .collect();
            // SAFETY: every entry lies in an MR the backend holds until the request completes.
            unsafe { h.setup_sge_list(&list) };
            guard.post().map_err(|e| (i, err("ibv_post_send", e)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_without_devices_has_no_nics_and_the_backend_says_so() {
        let p = Ibverbs::new(PathBuf::from("/sys"));
        let nics = p.open_all().expect("no device is an empty list, not an error");
        if crate::host_has_rdma_device() {
            eprintln!("this host has {} RDMA NIC port(s)", nics.len());
            return;
        }
        assert!(nics.is_empty());
        let e = crate::RdmaBackend::new(crate::RdmaConfig::default(), Arc::new(p)).unwrap_err();
        assert!(e.to_string().contains("no RDMA NIC (ibverbs provider)"), "{e}");
    }
}
