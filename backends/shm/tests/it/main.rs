//! The integration tests of `tensorwire-shm`, in one test binary: a module per concern.

mod cleanup;
mod conformance;
mod groups;
mod leases;
mod selection;
mod two_process;

tensorwire_conformance::children! {
    "engine" => two_process::child,
    "cleanup" => cleanup::cleanup_child,
    "cleanup-peer" => cleanup::peer_child,
}
