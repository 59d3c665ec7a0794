//! The integration tests of `tensorwire-store`, in one test binary: a module per concern.

mod cluster;
mod faults;
mod restart;
mod secure_node;
mod store_suite;
