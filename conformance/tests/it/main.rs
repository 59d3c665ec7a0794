//! The integration tests of `tensorwire-conformance`, in one test binary: a module per concern.

mod gpu_seam;
mod reference;
mod secure_engine;
