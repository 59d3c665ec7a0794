//! The whole conformance suite over tcp with every region in device memory of a fake GPU (see
//! `tensorwire_testkit::fake_gpu`): the initiator's engine stages its device memory through
//! pinned bounces, the target's tcp server stages its own.

use std::sync::Arc;

use tensorwire_conformance::DevicePair;
use tensorwire_core::backend::Backend;
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::fake_gpu::FakeGpu;

fn tcp() -> Arc<dyn Backend> {
    TcpBackend::new(TcpConfig::default()).expect("a tcp backend")
}

tensorwire_conformance::conformance_tests!(DevicePair::new(tcp, FakeGpu::new));
