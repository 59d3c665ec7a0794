//! Local registrations: a region registered with every NIC that can take it (one MR each), and
//! the NICs its memory prefers. Host memory is registered directly; device memory through a
//! dma-buf the GPU crate exports ([`DeviceMemory`], GPUDirect RDMA), or not at all (the engine
//! then moves it with another backend).

use std::fmt::Debug;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tensorwire_core::backend::RegionInfo;
use tensorwire_core::{Error, MemoryKind, Permissions, RegionId, Result};

use crate::NAME;
use crate::affinity::{self, Placement};
use crate::blob::RegionKeys;
use crate::verbs::{Mr, MrAccess, Nic, NicInfo};

/// What the backend needs from a GPU crate to register device memory with NICs (GPUDirect
/// RDMA): a dma-buf of the memory, and where the GPU sits on the PCIe tree.
pub trait DeviceMemory: Send + Sync + Debug + 'static {
    /// A dma-buf exporting `[ptr, ptr + len)` of device `ordinal`'s memory
    /// (`cuMemGetHandleForAddressRange`), and the offset of `ptr` in it.
    fn dmabuf(&self, ptr: u64, len: u64, ordinal: u32) -> Result<(OwnedFd, u64)>;
    /// The GPU's sysfs PCI path, for choosing the nearest NIC.
    fn pci_path(&self, ordinal: u32) -> Option<String>;
}

/// A region as this backend registered it.
#[derive(Debug)]
pub(crate) struct LocalRegion {
    /// One MR per NIC (by NIC index), `None` where that NIC could not register it.
    pub(crate) mrs: Vec<Option<Box<dyn Mr>>>,
    /// NICs (bit i: NIC i) its memory prefers.
    pub(crate) preferred: u64,
    /// Its length.
    pub(crate) len: u64,
    /// Set when its deregistration starts: no lease is granted from then on.
    pub(crate) closing: AtomicBool,
}

impl LocalRegion {
    /// The rkeys of its MRs, as its public blob lists them.
    pub(crate) fn keys(&self) -> RegionKeys {
        RegionKeys(
            self.mrs
                .iter()
                .enumerate()
                .filter_map(|(i, m)| m.as_ref().map(|m| (i as u8, m.rkey())))
                .collect(),
        )
    }

    /// The address of its first byte on each NIC that registered it.
    pub(crate) fn bases(&self) -> Vec<(u8, u64)> {
        self.mrs
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.as_ref().map(|m| (i as u8, m.base())))
            .collect()
    }

    /// NICs (bit i) that registered it.
    pub(crate) fn on(&self) -> u64 {
        self.mrs.iter().enumerate().filter(|(_, m)| m.is_some()).fold(0, |a, (i, _)| a | (1 << i))
    }
}

fn access(perms: Permissions) -> MrAccess {
    MrAccess { local_write: true, remote_read: perms.read, remote_write: perms.write }
}

/// Registers `region` with every NIC; `None` when no NIC can reach its memory.
pub(crate) fn register(
    nics: &[Arc<dyn Nic>],
    infos: &[NicInfo],
    region: &RegionInfo,
    device: Option<&Arc<dyn DeviceMemory>>,
) -> Result<Option<LocalRegion>> {
    let acc = access(region.perms);
    let len = region.len;
    if len == 0 {
        // Nothing to register: ops on it move no bytes.
        return Ok(Some(LocalRegion {
            mrs: nics.iter().map(|_| None).collect(),
            preferred: 0,
            len,
            closing: AtomicBool::new(false),
        }));
    }
    let (mrs, place) = match region.kind {
        MemoryKind::Host | MemoryKind::HostPinned => {
            let addr = region.base() as usize;
            let mrs = nics
                .iter()
                .map(|nic| {
                    let keep = region.shareable().cloned().map(|s| Box::new(s) as _);
                    // SAFETY: the engine keeps a region's memory valid until `deregister` for it
                    // returns (its contract for registered memory), and this MR is dropped by
                    // then or (held by an op still in flight) together with the op's slice,
                    // which keeps the memory; engine memory is also kept by `keep`.
                    match unsafe { nic.reg_mr(addr, len, acc, keep) } {
                        Ok(mr) => Some(mr),
                        Err(e) => {
                            tracing::warn!(nic = %nic.info().address.name, error = %e, "rdma: cannot register a region");
                            None
                        }
                    }
                })
                .collect();
            (mrs, Placement::Host(affinity::numa_node_of(addr)))
        }
        MemoryKind::Device { ordinal } => {
            let Some(dev) = device else {
                // The peer-memory path: NICs whose kernel has a GPU peer-memory client take
                // the device address itself.
                let mrs: Vec<_> = nics
                    .iter()
                    .map(|nic| {
                        if !nic.peer_memory() {
                            return None;
                        }
                        let addr = region.base() as u64;
                        // SAFETY: device memory the engine keeps allocated until `deregister`
                        // for it returns; the MR goes by then. Nothing here dereferences it.
                        unsafe { nic.reg_device_mr(addr, len, acc) }
                            .map_err(|e| tracing::warn!(nic = %nic.info().address.name, error = %e, "rdma: cannot register device memory"))
                            .ok()
                    })
                    .collect();
                let r = LocalRegion {
                    mrs,
                    preferred: crate::dispatch::mask_of(nics.len()),
                    len,
                    closing: AtomicBool::new(false),
                };
                return Ok((r.on() != 0).then_some(r));
            };
            let (fd, offset) = dev.dmabuf(region.base() as u64, len, ordinal)?;
            let mrs = nics
                .iter()
                .map(|nic| {
                    // SAFETY: the dma-buf exports the region's device memory, which the engine
                    // keeps valid until `deregister` for it returns; the MR goes by then.
                    match unsafe { nic.reg_dmabuf_mr(fd.as_raw_fd(), offset, len, acc) } {
                        Ok(mr) => Some(mr),
                        Err(e) => {
                            tracing::warn!(nic = %nic.info().address.name, error = %e, "rdma: cannot register device memory");
                            None
                        }
                    }
                })
                .collect();
            (mrs, Placement::Device(dev.pci_path(ordinal)))
        }
    };
    let r = LocalRegion {
        mrs,
        preferred: affinity::preferred(infos, &place),
        len,
        closing: AtomicBool::new(false),
    };
    if r.on() == 0 {
        return Ok(None);
    }
    Ok(Some(r))
}

/// The error of an op whose local region this backend does not hold.
pub(crate) fn unregistered(id: RegionId) -> Error {
    Error::Unsupported {
        backend: NAME,
        what: format!("local region {} is not registered with any RDMA NIC", id.0),
    }
}
