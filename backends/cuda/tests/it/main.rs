//! The integration tests of `tensorwire-cuda`, in one test binary: a module per concern.

mod conformance;
mod gpu;
mod ipc;
