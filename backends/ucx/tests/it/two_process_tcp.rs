//! Two OS processes over UCX's TCP transport on loopback: a
//! chunked 64 MiB tensor to a child process, and a child stopped then killed mid-transfer (suite in
//! `tensorwire_conformance::multiprocess`). A short answer bound detects the stopped peer.
//! `two_process.rs` runs the same over the shared-memory transports.
tensorwire_conformance::multiprocess_tests!("engine-tcp", || {
    use std::time::Duration;
    use tensorwire_ucx::{UcxBackend, UcxConfig};
    let cfg = UcxConfig { answer_timeout: Duration::from_secs(2), ..UcxConfig::transports("tcp") };
    UcxBackend::with_config(cfg).expect("start ucx")
});
