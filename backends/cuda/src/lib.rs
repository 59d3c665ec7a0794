//! `tensorwire-cuda`: GPU memory for the engine through the CUDA driver API ([`CudaGpu`], the
//! engine's [`tensorwire_core::gpu::Gpu`]): device allocations (`cuMemAlloc`), page-locked host
//! memory (`cuMemHostRegister`), device pointer checks (`cuPointerGetAttribute`) and every copy
//! that involves device memory (`cuMemcpy`, with unified addressing: host to device, device to
//! host, device to device and between GPUs).
//!
//! The driver is loaded at run time through cudarc's `dynamic-loading`: building needs no CUDA
//! toolkit, and on a machine without the NVIDIA driver [`CudaGpu::new`] returns `Unsupported`
//! naming what is missing (it checks for libcuda before any context is made).
//!
//! ```no_run
//! # async fn demo() -> tensorwire_core::Result<()> {
//! use tensorwire_core::{Engine, Permissions};
//! let gpu = tensorwire_cuda::CudaGpu::new()?;
//! let tcp = tensorwire_tcp::TcpBackend::new(Default::default())?;
//! let engine = Engine::builder().backend(tcp).gpu(gpu).start().await?;
//! let latents = engine.alloc_device(0, 8 << 20, Permissions::READ).await?;
//! # Ok(()) }
//! ```

mod driver;
mod event;
mod gpu;
pub mod ipc;
mod medium;

use std::sync::Arc;

pub use event::CudaEvent;
pub use gpu::{CudaGpu, driver_present};
pub use medium::{CudaIpc, IpcDriver};
use tensorwire_core::Result;
pub use tensorwire_shm::{ShmBackend, ShmConfig};

/// The cuda backend ("cuda"): the same-host protocol of `tensorwire-shm` over [`CudaIpc`], with
/// `driver` ([`CudaGpu`] on a GPU machine) and `cfg` (how long a silent peer is waited for).
/// Put it first among an engine's backends: it serves ops on the peer's device regions between
/// engines of one host, and the engine picks the next backend for host memory and for peers on
/// other hosts.
pub fn backend(driver: Arc<dyn IpcDriver>, cfg: ShmConfig) -> Result<Arc<ShmBackend>> {
    ShmBackend::with_medium(Arc::new(CudaIpc::new(driver)), cfg)
}

/// This crate's name in errors.
pub const NAME: &str = "cuda";
