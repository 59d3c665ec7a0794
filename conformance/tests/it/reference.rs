//! The reference backend runs the whole suite: one test per suite function, and `run_all` through
//! `Arc<dyn Backend>` built by a plain factory.

use std::sync::Arc;

use tensorwire_conformance::{BackendPair, PairFactory, run_all, test_names};
use tensorwire_core::{backend::Backend, backend::MemBackend};

fn mem() -> Arc<dyn Backend> {
    MemBackend::new()
}

tensorwire_conformance::conformance_tests!(BackendPair::new(mem));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_suite_through_run_all() {
    let f = BackendPair::new(mem);
    let dynf: &dyn PairFactory = &f;
    run_all(dynf).await;
    assert!(test_names().len() >= 20, "the suite has {} tests", test_names().len());
}
