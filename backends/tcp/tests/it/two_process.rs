//! Two OS processes over real sockets: a chunked 64 MiB tensor to a child process, and a child
//! stopped then killed mid-transfer (the suite lives in `tensorwire_conformance::multiprocess`).
//! The stall bound is short here, so a stopped peer is detected by the backend's own watchdog.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::backend::Backend;
use tensorwire_tcp::{TcpBackend, TcpConfig};

fn tcp() -> Arc<dyn Backend> {
    let cfg = TcpConfig { stall_timeout: Duration::from_secs(2), ..TcpConfig::default() };
    TcpBackend::new(cfg).expect("bind tcp backend")
}

tensorwire_conformance::multiprocess_tests!("engine", tcp);
