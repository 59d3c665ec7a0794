//! Two OS processes over UCX's shared-memory transports (UCX 1.13 does put/get in software over posix/sysv messages): a
//! chunked 64 MiB tensor to a child process, and a child stopped then killed mid-transfer (suite in
//! `tensorwire_conformance::multiprocess`). A short answer bound detects the stopped peer.
//! `two_process_tcp.rs` runs the same over UCX's TCP transport.
tensorwire_conformance::multiprocess_tests!("engine-sm", || {
    use std::time::Duration;
    use tensorwire_ucx::{UcxBackend, UcxConfig};
    let cfg =
        UcxConfig { answer_timeout: Duration::from_secs(2), ..UcxConfig::transports("sm,self") };
    UcxBackend::with_config(cfg).expect("start ucx")
});
