//! The whole conformance suite over the NCCL backend's protocol with the host-memory fake
//! communicator (two ranks in this process): grants, matched send/receive pairs in grant
//! order, notifications, refusals, a dead peer, cancellation. The real data path needs two GPUs.

use std::sync::Arc;

use tensorwire_conformance::BackendPair;
use tensorwire_core::backend::Backend;
use tensorwire_nccl::fake::FakeNccl;
use tensorwire_nccl::{NcclBackend, NcclConfig};

fn nccl() -> Arc<dyn Backend> {
    NcclBackend::new(NcclConfig::default(), FakeNccl::new()).expect("an nccl backend")
}

tensorwire_conformance::conformance_tests!(BackendPair::new(nccl));
