//! Two OS processes on one host: a chunked 64 MiB tensor to a child process through shared
//! mappings, and a child stopped then killed mid-transfer (suite in
//! `tensorwire_conformance::multiprocess`). A short answer bound detects the stopped peer.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::backend::Backend;
use tensorwire_shm::{ShmBackend, ShmConfig};

fn shm() -> Arc<dyn Backend> {
    let cfg = ShmConfig { answer_timeout: Duration::from_secs(2) };
    ShmBackend::with_config(cfg).expect("bind shm backend")
}

tensorwire_conformance::multiprocess_tests!("engine", shm);
