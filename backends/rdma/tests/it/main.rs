//! The integration tests of `tensorwire-rdma`, in one test binary: a module per concern.

mod conformance;
mod faults;
mod gpudirect;
mod hardware;
