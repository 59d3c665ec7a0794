//! GPUDirect registration behind a fake GPU: "device memory" is a memfd that only the fake's
//! dma-buf export reaches (the engine never dereferences the region's device address), and the
//! software NIC reaches it through that export, as a NIC reaches a GPU's dma-buf. A WRITE from
//! host memory lands in it and a READ brings it back, byte for byte.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use tensorwire_conformance::{bounded, pattern};
use tensorwire_core::{Engine, Error, MemoryKind, Permissions, TransferOp};
use tensorwire_rdma::soft::{SoftFabric, SoftNicSpec, SoftProvider};
use tensorwire_rdma::{DeviceMemory, RdmaBackend, RdmaConfig};

/// A fake GPU: one "allocation" at a made-up device address, backed by a memfd.
#[derive(Debug)]
struct FakeGpu {
    memfd: OwnedFd,
    base: u64,
    len: u64,
}

impl FakeGpu {
    fn new(len: u64) -> FakeGpu {
        // SAFETY: a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"fake-gpu".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sizing our memfd.
        assert_eq!(unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) }, 0);
        FakeGpu { memfd, base: 0x7e00_0000_0000, len }
    }

    fn read(&self, off: u64, out: &mut [u8]) {
        // SAFETY: reading into a live buffer from our memfd.
        let n = unsafe {
            libc::pread(self.memfd.as_raw_fd(), out.as_mut_ptr().cast(), out.len(), off as i64)
        };
        assert_eq!(n as usize, out.len());
    }

    fn write(&self, off: u64, data: &[u8]) {
        // SAFETY: writing a live buffer to our memfd.
        let n = unsafe {
            libc::pwrite(self.memfd.as_raw_fd(), data.as_ptr().cast(), data.len(), off as i64)
        };
        assert_eq!(n as usize, data.len());
    }
}

impl DeviceMemory for FakeGpu {
    fn dmabuf(&self, ptr: u64, len: u64, ordinal: u32) -> tensorwire_core::Result<(OwnedFd, u64)> {
        if ordinal != 0 || ptr < self.base || ptr + len > self.base + self.len {
            return Err(Error::InvalidArgument(format!("not this GPU's memory: {ptr:#x}+{len}")));
        }
        Ok((self.memfd.try_clone()?, ptr - self.base))
    }

    fn pci_path(&self, _ordinal: u32) -> Option<String> {
        None
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_regions_move_through_their_dma_buf() {
    let fabric = SoftFabric::new();
    let gpu = Arc::new(FakeGpu::new(8 << 20));
    let mk = |dev: Option<Arc<dyn DeviceMemory>>| {
        let nics = SoftProvider::new(&fabric, 2, SoftNicSpec::default());
        RdmaBackend::new(RdmaConfig { device_memory: dev, ..RdmaConfig::default() }, nics).unwrap()
    };
    let a = Engine::builder().backend(mk(None)).start().await.unwrap();
    let b = Engine::builder().backend(mk(Some(gpu.clone()))).start().await.unwrap();
    let len = 4u64 << 20;
    // SAFETY: the fake device address range stays "allocated" (the memfd lives in `gpu`) past the
    // deregistration below; nothing dereferences it.
    let dev = unsafe {
        b.register_raw(
            (gpu.base + (1 << 20)) as *mut u8,
            len,
            MemoryKind::Device { ordinal: 0 },
            Permissions::READ_WRITE,
        )
    }
    .await
    .unwrap();
    assert!(dev.remote().blob("rdma").is_some(), "the device region is registered with the NICs");
    let host = a.alloc(len, Permissions::NONE).await.unwrap();
    let data = pattern(len as usize, 42);
    host.write_bytes(0, &data).unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let r = bounded("write", s.transfer(TransferOp::write(&host, 0, &dev.remote(), 0, len)))
        .await
        .unwrap();
    assert_eq!(r.backend, "rdma");
    let mut got = vec![0u8; len as usize];
    gpu.read(1 << 20, &mut got);
    assert!(got == data, "the bytes landed in the device memory");
    gpu.write((1 << 20) + 100, b"from the gpu");
    bounded("read", s.transfer(TransferOp::read(&host, 0, &dev.remote(), 100, 12))).await.unwrap();
    assert_eq!(host.to_vec(0, 12).unwrap(), b"from the gpu");
    bounded("deregister", dev.deregister()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_dma_buf_source_device_regions_are_not_taken() {
    let fabric = SoftFabric::new();
    let nics = SoftProvider::new(&fabric, 1, SoftNicSpec::default());
    let rdma = RdmaBackend::new(RdmaConfig::default(), nics).unwrap();
    assert!(!tensorwire_core::backend::Backend::capabilities(&*rdma).local.device);
    let e = Engine::builder().backend(rdma).start().await.unwrap();
    // SAFETY: a made-up device address nothing dereferences; the region is dropped at once.
    let r = unsafe {
        e.register_raw(
            0x7e00_0000_0000 as *mut u8,
            4096,
            MemoryKind::Device { ordinal: 0 },
            Permissions::READ,
        )
    }
    .await
    .unwrap();
    assert!(r.remote().blob("rdma").is_none(), "no NIC could reach it, so no blob");
    r.deregister().await.unwrap();
}
