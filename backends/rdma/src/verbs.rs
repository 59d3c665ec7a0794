//! The verbs seam: the part of an RDMA NIC the backend uses, as object-safe traits. Two
//! implementations exist: [`crate::soft`] (a software NIC in this process, for tests and for
//! machines without RDMA) and `ibv` (libibverbs through `sideway`, feature `verbs`).
//!
//! The shapes follow ibverbs: a [`Provider`] lists and opens [`Nic`]s (device context plus one
//! protection domain each); a NIC registers memory ([`Mr`]), makes completion queues ([`Cq`],
//! with a completion-channel descriptor to sleep on) and reliable-connected queue pairs ([`Qp`],
//! RESET -> INIT -> RTR -> RTS, or ERROR); a QP takes RDMA WRITE and READ work requests ([`Wr`])
//! with scatter/gather lists; a CQ yields work completions ([`Wc`]).
//!
//! Ownership is the ibverbs crate's: every object keeps what it was made from alive (a QP its NIC
//! and CQ, an MR its NIC), and dropping an object destroys it. Dropping an [`Mr`] returns only
//! once the NIC no longer touches its memory.

use std::fmt::{self, Debug};
use std::os::fd::RawFd;
use std::sync::Arc;

/// An error of the verbs layer: the call that failed and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsError {
    /// The verb ("ibv_reg_mr", "post_send", ...).
    pub call: &'static str,
    /// What happened (an errno text, a refused state, ...).
    pub what: String,
}

impl VerbsError {
    /// An error of `call`.
    pub fn new(call: &'static str, what: impl Into<String>) -> VerbsError {
        VerbsError { call, what: what.into() }
    }

    /// An error of `call` from the OS's last error (errno).
    pub fn last_os(call: &'static str) -> VerbsError {
        VerbsError::new(call, std::io::Error::last_os_error().to_string())
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.call, self.what)
    }
}

impl std::error::Error for VerbsError {}

/// Result of a verb.
pub type VResult<T> = std::result::Result<T, VerbsError>;

/// How a port's packets travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID within a subnet.
    Infiniband,
    /// RoCE: addressed by GID.
    Ethernet,
}

/// How peers reach a NIC port: what the backend's endpoint blob carries for each of its NICs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicAddress {
    /// Device name ("mlx5_0", "softnic0").
    pub name: String,
    /// Port number (1-based, as in ibverbs).
    pub port: u8,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Global identifier of the port (the one at `gid_index`).
    pub gid: [u8; 16],
    /// GID table index used.
    pub gid_index: u8,
    /// Link layer.
    pub link: LinkLayer,
    /// Active MTU as ibverbs codes it (1: 256 bytes .. 5: 4096 bytes).
    pub mtu: u8,
    /// Which NICs can reach each other: the IB subnet prefix, a RoCE network, or a software
    /// fabric's id. NICs of two engines are paired only when these are equal.
    pub fabric: u64,
}

impl NicAddress {
    /// Whether a local NIC can reach this one.
    pub fn reachable_from(&self, local: &NicInfo) -> bool {
        let l = &local.address;
        local.active && l.fabric == self.fabric && l.link == self.link
    }

    /// The address of QP `qpn` (first PSN `psn`) on this NIC.
    pub fn qp(&self, qpn: u32, psn: u32) -> QpAddress {
        QpAddress { qpn, psn, lid: self.lid, gid: self.gid, mtu: self.mtu }
    }
}

/// What the backend knows of one NIC (a device's port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicInfo {
    /// How peers reach it.
    pub address: NicAddress,
    /// NUMA node the NIC is attached to (from sysfs), if known.
    pub numa_node: Option<u32>,
    /// The NIC's PCI device path in sysfs (`/sys/devices/pci0000:00/...`), for PCIe distances.
    pub pci_path: Option<String>,
    /// Whether the port is up.
    pub active: bool,
}

/// Remote access a memory registration grants (local read is always granted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MrAccess {
    /// The NIC may write into it (the destination of a READ).
    pub local_write: bool,
    /// Peers may READ it.
    pub remote_read: bool,
    /// Peers may WRITE it.
    pub remote_write: bool,
}

/// A registration of memory with a NIC. Dropping it deregisters (and waits until the NIC no
/// longer touches the memory).
pub trait Mr: Send + Sync + Debug {
    /// Key for local scatter/gather entries.
    fn lkey(&self) -> u32;
    /// Key peers put in their work requests.
    fn rkey(&self) -> u32;
    /// The address a work request names for the region's first byte (its virtual address, or
    /// the I/O virtual address of a dma-buf registration).
    fn base(&self) -> u64;
}

/// One contiguous piece of local registered memory in a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Address (in the local MR's address space).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The local MR's key.
    pub lkey: u32,
}

/// The operation of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOp {
    /// RDMA WRITE: the local scatter list into remote memory.
    Write,
    /// RDMA READ: remote memory into the local scatter list.
    Read,
}

/// A work request, as posted to a QP's send queue.
#[derive(Debug, Clone, Copy)]
pub struct Wr<'a> {
    /// Caller's id, returned in the completion.
    pub id: u64,
    /// WRITE or READ.
    pub op: WrOp,
    /// Local memory, in order.
    pub sges: &'a [Sge],
    /// Remote address of the first byte.
    pub remote_addr: u64,
    /// Remote MR key.
    pub rkey: u32,
}

/// The status of a work completion, as ibverbs names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// A local scatter entry did not fit its MR (a bug here).
    LocalLength,
    /// A local key or access right was wrong (a bug here).
    LocalProtection,
    /// The QP was in error: the request never ran.
    Flushed,
    /// The remote NIC refused the access: key, bounds or permission.
    RemoteAccess,
    /// The remote NIC could not make sense of the request (e.g. longer than its MR).
    RemoteInvalidRequest,
    /// The remote side failed the operation.
    RemoteOperation,
    /// The transport retried until it gave up: the peer is unreachable.
    RetryExceeded,
    /// The receiver was not ready until the retries ran out.
    RnrRetryExceeded,
    /// Any other status (its ibverbs code).
    Other(u32),
}

impl WcStatus {
    /// Whether the status says the path (this QP, its link, the peer's NIC) failed, so the same
    /// request may succeed on another rail; remote access errors say the request itself is bad.
    pub fn is_path_failure(self) -> bool {
        matches!(
            self,
            WcStatus::Flushed
                | WcStatus::RemoteOperation
                | WcStatus::RetryExceeded
                | WcStatus::RnrRetryExceeded
                | WcStatus::Other(_)
        )
    }
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The work request's id.
    pub id: u64,
    /// How it ended.
    pub status: WcStatus,
}

/// A completion queue with a completion channel: after [`Cq::arm`], the next completion makes
/// [`Cq::event_fd`] readable.
pub trait Cq: Send + Sync + Debug {
    /// The completion channel's descriptor (non-blocking): readable when an event is queued.
    fn event_fd(&self) -> RawFd;
    /// Requests an event for the next completion (`ibv_req_notify_cq`).
    fn arm(&self) -> VResult<()>;
    /// Consumes and acknowledges the queued events (`ibv_get_cq_event`, `ibv_ack_cq_events`);
    /// returns how many there were (0 when none, never blocks).
    fn take_events(&self) -> VResult<u32>;
    /// Moves up to `max` completions into `out`; returns how many.
    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> VResult<usize>;
    /// The CQ as `Any`, for the provider that made it (a QP takes only its own device's CQs).
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

/// What a peer needs to connect a QP to this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAddress {
    /// QP number.
    pub qpn: u32,
    /// First packet sequence number of its send queue.
    pub psn: u32,
    /// Its port's LID.
    pub lid: u16,
    /// Its port's GID.
    pub gid: [u8; 16],
    /// Its port's MTU code.
    pub mtu: u8,
}

/// Transport settings of a connected QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpTiming {
    /// Local ACK timeout exponent (4.096 us x 2^timeout).
    pub timeout: u8,
    /// Transport retries before a `RetryExceeded` completion.
    pub retry_count: u8,
    /// RNR retries.
    pub rnr_retry: u8,
    /// Outstanding RDMA READs (initiator and responder depth).
    pub max_rd_atomic: u8,
}

impl Default for QpTiming {
    fn default() -> Self {
        QpTiming { timeout: 14, retry_count: 7, rnr_retry: 7, max_rd_atomic: 16 }
    }
}

/// The state of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created.
    Reset,
    /// Initialised (port, access).
    Init,
    /// Ready to receive (connected to its peer).
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: queued requests are flushed.
    Error,
}

/// A reliable-connected queue pair.
pub trait Qp: Send + Sync + Debug {
    /// Its number.
    fn qpn(&self) -> u32;
    /// Its current state.
    fn state(&self) -> QpState;
    /// RESET -> INIT, allowing peers remote READ and WRITE through it (the MRs decide what).
    fn init(&self) -> VResult<()>;
    /// INIT -> RTR -> RTS, connected to `remote`, with `psn` as this side's first send PSN.
    fn connect(&self, psn: u32, remote: &QpAddress, timing: &QpTiming) -> VResult<()>;
    /// Any state -> ERROR: queued and later requests complete as [`WcStatus::Flushed`].
    fn to_error(&self) -> VResult<()>;
    /// Posts signalled work requests, in order. On an error nothing after the failing one was
    /// posted; the returned count says how many were.
    fn post(&self, wrs: &[Wr<'_>]) -> std::result::Result<(), (usize, VerbsError)>;
}

/// Sizes of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth (work requests outstanding at once).
    pub max_send_wr: u32,
    /// Scatter/gather entries per request.
    pub max_sge: u32,
}

/// Something that keeps registered memory alive while an MR of it exists (engine memory
/// passes its mapping): a NIC that pins pages needs none; the software NIC holds it.
pub type Keep = Box<dyn std::any::Any + Send + Sync>;

/// One NIC, opened: a device context and its protection domain.
pub trait Nic: Send + Sync + Debug {
    /// What it is and how peers reach it.
    fn info(&self) -> &NicInfo;
    /// Registers host memory.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be host memory that stays valid (mapped, not freed) until the
    /// returned MR is dropped, or `keep` must keep it so.
    unsafe fn reg_mr(
        &self,
        addr: usize,
        len: u64,
        access: MrAccess,
        keep: Option<Keep>,
    ) -> VResult<Box<dyn Mr>>;
    /// Registers memory exported as a dma-buf (device memory: GPUDirect RDMA).
    ///
    /// # Safety
    /// `fd` must be a dma-buf whose bytes `[offset, offset + len)` stay valid until the returned
    /// MR is dropped.
    unsafe fn reg_dmabuf_mr(
        &self,
        fd: RawFd,
        offset: u64,
        len: u64,
        access: MrAccess,
    ) -> VResult<Box<dyn Mr>>;
    /// Registers device memory by its device address, through the kernel's peer-memory client
    /// (`nvidia-peermem`): the NIC resolves the GPU's pages itself. An error where no such client
    /// is loaded, and always on the software NIC (which never dereferences device memory).
    ///
    /// # Safety
    /// `[addr, addr + len)` must be device memory that stays allocated until the MR is dropped.
    unsafe fn reg_device_mr(&self, addr: u64, len: u64, access: MrAccess) -> VResult<Box<dyn Mr>>;
    /// Whether [`Nic::reg_device_mr`] can work on this NIC (a peer-memory client is loaded).
    fn peer_memory(&self) -> bool;
    /// A completion queue of at least `depth` entries, with its own completion channel.
    fn create_cq(&self, depth: u32) -> VResult<Arc<dyn Cq>>;
    /// A reliable-connected QP (in RESET) whose send and receive completions go to `cq`.
    fn create_qp(&self, cq: &Arc<dyn Cq>, caps: QpCaps) -> VResult<Arc<dyn Qp>>;
}

/// Where NICs come from.
pub trait Provider: Send + Sync + Debug {
    /// Its name ("ibverbs", "softnic").
    fn name(&self) -> &'static str;
    /// Every NIC port it has, opened. No device is an empty list, not an error.
    fn open_all(&self) -> VResult<Vec<Arc<dyn Nic>>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_failures_are_retried_and_access_errors_are_not() {
        for s in [WcStatus::Flushed, WcStatus::RetryExceeded, WcStatus::RnrRetryExceeded] {
            assert!(s.is_path_failure(), "{s:?}");
        }
        for s in [
            WcStatus::Success,
            WcStatus::RemoteAccess,
            WcStatus::RemoteInvalidRequest,
            WcStatus::LocalProtection,
            WcStatus::LocalLength,
        ] {
            assert!(!s.is_path_failure(), "{s:?}");
        }
        assert_eq!(VerbsError::new("post_send", "ENOMEM").to_string(), "post_send: ENOMEM");
    }
}
