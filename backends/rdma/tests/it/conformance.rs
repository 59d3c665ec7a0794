//! The whole conformance suite over the software NIC: two engines in this process, each with two
//! software NICs on one fabric (two NIC pairs, two QPs each: four rails per connection).

use std::sync::Arc;

use tensorwire_conformance::BackendPair;
use tensorwire_core::backend::Backend;
use tensorwire_rdma::soft::SoftFabric;
use tensorwire_rdma::{RdmaBackend, RdmaConfig};

fn soft() -> Arc<dyn Backend> {
    let (b, _nics) = RdmaBackend::soft(RdmaConfig::default(), &SoftFabric::global(), 2)
        .expect("an rdma backend on software NICs");
    b
}

tensorwire_conformance::conformance_tests!(BackendPair::new(soft));
