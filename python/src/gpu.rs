//! The process's GPU driver, chosen once, for every engine the package makes: the CUDA driver
//! (`tensorwire-cuda`, `libcuda.so.1` loaded at run time, so one wheel serves hosts with and
//! without a GPU), or, behind the testing switch [`FAKE_SWITCH`], the fake GPU the Rust tests use
//! (device memory the CPU cannot touch) with its fake CUDA IPC driver. Without either, a device
//! tensor is refused with the reason, and host tensors move as before.

use std::sync::{Arc, OnceLock};

use tensorwire_core::EngineBuilder;
use tensorwire_core::backend::Backend;
use tensorwire_cuda::CudaGpu;
use tensorwire_testkit::fake_gpu::FakeGpu;
use tensorwire_testkit::fake_ipc::FakeIpc;

use crate::errors::{Failure, Res};

/// The environment variable that, set to `1` before the first engine is made, gives the
/// process the fake GPU instead of the CUDA driver: for tests, never for serving.
pub(crate) const FAKE_SWITCH: &str = "TENSORWIRE_TESTING_FAKE_CUDA";

/// A GPU driver the engines share.
pub(crate) enum Driver {
    /// The NVIDIA driver.
    Cuda(Arc<CudaGpu>),
    /// The fake GPU and its IPC driver (tests).
    Fake(Arc<FakeGpu>, Arc<FakeIpc>),
}

/// The driver, or why there is none (asked once per process).
fn chosen() -> &'static Result<Driver, String> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    DRIVER.get_or_init(|| {
        if std::env::var(FAKE_SWITCH).is_ok_and(|v| v == "1") {
            let gpu = FakeGpu::new();
            return Ok(Driver::Fake(gpu.clone(), FakeIpc::new(gpu)));
        }
        CudaGpu::new().map(Driver::Cuda).map_err(|e| e.to_string())
    })
}

/// The process's driver, or the error a device tensor gets without one.
pub(crate) fn driver() -> Res<&'static Driver> {
    chosen().as_ref().map_err(|why| {
        Failure::new(
            "UnsupportedError",
            format!("device memory needs the CUDA driver, and this process has none: {why}"),
        )
    })
}

/// The fake GPU and IPC driver, when the testing switch chose them.
pub(crate) fn fake() -> Res<(&'static Arc<FakeGpu>, &'static Arc<FakeIpc>)> {
    match chosen() {
        Ok(Driver::Fake(gpu, ipc)) => Ok((gpu, ipc)),
        _ => Err(Failure::invalid(format!(
            "the fake CUDA device is for tests: set {FAKE_SWITCH}=1 in the environment before \
             the first engine or fake tensor of the process is made"
        ))),
    }
}

/// True when the process has a GPU driver (real or fake).
pub(crate) fn present() -> bool {
    chosen().is_ok()
}

/// The device whose memory holds `addr`, asked of the process's GPU driver; `None` without a
/// driver or for memory that is not device memory.
pub(crate) fn device_of(addr: u64) -> Option<u32> {
    match chosen() {
        Ok(Driver::Cuda(gpu)) => gpu.device_of(addr),
        Ok(Driver::Fake(gpu, _)) => gpu.allocation(addr).map(|(_, _, o)| o),
        Err(_) => None,
    }
}

/// `b` with the process's GPU driver, if it has one.
pub(crate) fn equip(b: EngineBuilder) -> EngineBuilder {
    match chosen() {
        Ok(Driver::Cuda(gpu)) => b.gpu(gpu.clone()),
        Ok(Driver::Fake(gpu, _)) => b.gpu(gpu.clone()),
        Err(_) => b,
    }
}

/// The cuda backend (CUDA IPC between engines of one host) over the process's driver.
pub(crate) fn cuda_backend() -> Res<Arc<dyn Backend>> {
    let cfg = tensorwire_shm::ShmConfig::default();
    Ok(match driver()? {
        Driver::Cuda(gpu) => tensorwire_cuda::backend(gpu.clone(), cfg)?,
        Driver::Fake(_, ipc) => tensorwire_cuda::backend(ipc.clone(), cfg)?,
    })
}

/// The process's GPU driver: "cuda", "fake" (the testing switch), or None, with the reason there
/// is none.
#[pyo3::pyfunction]
pub(crate) fn gpu_driver() -> (Option<&'static str>, Option<String>) {
    match chosen() {
        Ok(Driver::Cuda(_)) => (Some("cuda"), None),
        Ok(Driver::Fake(..)) => (Some("fake"), None),
        Err(why) => (None, Some(why.clone())),
    }
}
