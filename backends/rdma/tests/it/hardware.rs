//! The conformance suite on real RDMA NICs (libibverbs), when this host has one and this build
//! has the `verbs` feature; it is ignored unless asked for, and asked for on a host without one
//! it fails saying why (it never reports a pass it did not earn). On a host with RDMA (or
//! Soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`):
//! `cargo test -p tensorwire-rdma --features verbs --test it -- --include-ignored hardware::`.

#[test]
#[ignore = "needs an RDMA NIC and the `verbs` feature: --include-ignored hardware::"]
fn rdma_conformance_on_real_nics() {
    assert!(
        tensorwire_rdma::host_has_rdma_device(),
        "no RDMA device here (/sys/class/infiniband is empty or absent)"
    );
    let provider = tensorwire_rdma::ibverbs_provider().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !provider.open_all().map(|n| n.is_empty()).unwrap_or(true),
        "libibverbs opened no NIC port (no driver, or no libibverbs.so.1)"
    );
    let make = move || -> std::sync::Arc<dyn tensorwire_core::backend::Backend> {
        let p = tensorwire_rdma::ibverbs_provider().expect("the ibverbs provider");
        tensorwire_rdma::RdmaBackend::new(tensorwire_rdma::RdmaConfig::default(), p)
            .expect("an rdma backend on this host's NICs")
    };
    let pair = tensorwire_conformance::BackendPair::new(make);
    tensorwire_conformance::harness::block_on(tensorwire_conformance::run_all(&pair));
}
