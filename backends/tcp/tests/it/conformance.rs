//! The whole conformance suite over real sockets on 127.0.0.1, with and without checksums.

use std::sync::Arc;

use tensorwire_conformance::BackendPair;
use tensorwire_core::backend::Backend;
use tensorwire_tcp::{TcpBackend, TcpConfig};

fn tcp() -> Arc<dyn Backend> {
    TcpBackend::new(TcpConfig::default()).expect("bind tcp backend")
}

tensorwire_conformance::conformance_tests!(BackendPair::new(tcp));

mod checksummed {
    use super::*;

    fn tcp_crc() -> Arc<dyn Backend> {
        let cfg =
            TcpConfig { checksum: true, piece_bytes: 1 << 20, streams: 3, ..TcpConfig::default() };
        TcpBackend::new(cfg).expect("bind tcp backend")
    }

    tensorwire_conformance::conformance_tests!(BackendPair::new(tcp_crc));
}
