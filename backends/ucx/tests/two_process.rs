//! Two OS processes over UCX's shared-memory transports (posix/sysv messages, CMA put/get): a
//! chunked 64 MiB tensor to a child process, and a child stopped then killed mid-transfer (suite in
//! `tensorwire_conformance::multiprocess`). A short answer bound detects the stopped peer.
//! (Over UCX's TCP transport the stopped-child case is not yet reliable: see the README.)
#![cfg(feature = "ucx")]

use std::time::Duration;

use tensorwire_ucx::{UcxBackend, UcxConfig};

tensorwire_conformance::multiprocess_tests!(|| {
    let cfg =
        UcxConfig { answer_timeout: Duration::from_secs(2), ..UcxConfig::transports("sm,self") };
    UcxBackend::with_config(cfg).expect("start ucx")
});
