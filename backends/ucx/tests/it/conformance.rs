//! The whole conformance suite over UCX, once with the TCP transport and once with the
//! shared-memory ones (posix/sysv active messages, CMA for put/get), on loopback. The suite drives
//! both engines itself, so they share a process (two UCX contexts and workers); `two_process.rs`
//! runs separate processes. Without the `ucx` feature there is nothing to run.
#![cfg(feature = "ucx")]

use std::sync::Arc;

use tensorwire_conformance::BackendPair;
use tensorwire_core::backend::Backend;
use tensorwire_ucx::{UcxBackend, UcxConfig};

mod tcp {
    use super::*;

    fn ucx_tcp() -> Arc<dyn Backend> {
        UcxBackend::with_config(UcxConfig::transports("tcp")).expect("start ucx over tcp")
    }

    tensorwire_conformance::conformance_tests!(BackendPair::new(ucx_tcp));
}

mod shared_memory {
    use super::*;

    fn ucx_sm() -> Arc<dyn Backend> {
        UcxBackend::with_config(UcxConfig::transports("sm,self")).expect("start ucx over sm")
    }

    tensorwire_conformance::conformance_tests!(BackendPair::new(ucx_sm));
}
