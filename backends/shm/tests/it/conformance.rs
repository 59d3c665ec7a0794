//! The whole conformance suite over shm: every op maps the peer's memfd (passed over the Unix
//! socket, even within one process) and copies once. The suite drives both engines directly, so it
//! runs them in one process; `two_process.rs` covers separate processes.

use std::sync::Arc;

use tensorwire_conformance::BackendPair;
use tensorwire_core::backend::Backend;
use tensorwire_shm::ShmBackend;

fn shm() -> Arc<dyn Backend> {
    ShmBackend::new().expect("bind shm backend")
}

tensorwire_conformance::conformance_tests!(BackendPair::new(shm));
