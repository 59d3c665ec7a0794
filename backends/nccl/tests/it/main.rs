//! The integration tests of `tensorwire-nccl`, in one test binary: a module per concern.

mod conformance;
mod real;
