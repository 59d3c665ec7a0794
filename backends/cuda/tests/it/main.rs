//! The integration tests of `tensorwire-cuda`, in one test binary: a module per concern.

mod conformance;
mod fake;
mod gpu;
mod ipc;
