//! `tensorwire._native`: the Rust half of the `tensorwire` Python package. Python code imports
//! `tensorwire`, whose modules wrap these classes (see `python/tensorwire/`).

mod connector;
mod dlpack;
mod engine;
mod errors;
mod fake_cuda;
mod gpu;
mod linger;
mod orchestrator;
mod runtime;
mod store;
mod stream;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Region>()?;
    m.add_class::<engine::Session>()?;
    m.add_class::<engine::PreparedTransfer>()?;
    m.add_class::<store::Store>()?;
    m.add_class::<store::StoreNode>()?;
    m.add_class::<connector::Connector>()?;
    m.add_class::<connector::Publication>()?;
    m.add_class::<connector::Consumption>()?;
    m.add_function(wrap_pyfunction!(connector::describe_handle, m)?)?;
    m.add_function(wrap_pyfunction!(linger::set_linger, m)?)?;
    m.add_class::<fake_cuda::FakeCudaMemory>()?;
    m.add_function(wrap_pyfunction!(fake_cuda::fake_cuda_counts, m)?)?;
    m.add_function(wrap_pyfunction!(fake_cuda::fake_cuda_stream, m)?)?;
    m.add_function(wrap_pyfunction!(fake_cuda::fake_cuda_hold, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::gpu_driver, m)?)?;
    m.add_class::<orchestrator::Service>()?;
    m.add_class::<orchestrator::Worker>()?;
    m.add_class::<orchestrator::Assignment>()?;
    m.add_class::<orchestrator::Submitter>()?;
    m.add_class::<orchestrator::Outcome>()?;
    Ok(())
}
