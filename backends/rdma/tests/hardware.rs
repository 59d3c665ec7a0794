//! The conformance suite on real RDMA NICs (libibverbs), when this host has one and this build
//! has the `verbs` feature; otherwise the test says it was skipped, and why (it never reports a
//! pass it did not earn). On a host with RDMA (or Soft-RoCE: `rdma link add rxe0 type rxe netdev
//! eth0`): `cargo test -p tensorwire-rdma --features verbs --test hardware`.

use std::process::ExitCode;

const NAME: &str = "rdma_conformance_on_real_nics";

fn skipped(why: &str) -> ExitCode {
    println!("\nrunning 1 test\ntest {NAME} ... SKIPPED: {why}");
    println!("\ntest result: ok. 0 passed; 0 failed; 1 skipped (no pass reported)\n");
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--list") {
        println!("{NAME}: test");
        return ExitCode::SUCCESS;
    }
    if !tensorwire_rdma::host_has_rdma_device() {
        return skipped("no RDMA device here (/sys/class/infiniband is empty or absent)");
    }
    let provider = match tensorwire_rdma::ibverbs_provider() {
        Ok(p) => p,
        Err(e) => return skipped(&e.to_string()),
    };
    if provider.open_all().map(|n| n.is_empty()).unwrap_or(true) {
        return skipped("libibverbs opened no NIC port (no driver, or no libibverbs.so.1)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let make = move || -> std::sync::Arc<dyn tensorwire_core::backend::Backend> {
        let p = tensorwire_rdma::ibverbs_provider().expect("the ibverbs provider");
        tensorwire_rdma::RdmaBackend::new(tensorwire_rdma::RdmaConfig::default(), p)
            .expect("an rdma backend on this host's NICs")
    };
    let pair = tensorwire_conformance::BackendPair::new(make);
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(tensorwire_conformance::run_all(&pair))
    }))
    .is_ok();
    println!("\nrunning 1 test\ntest {NAME} ... {}", if ok { "ok" } else { "FAILED" });
    if ok {
        println!("\ntest result: ok. 1 passed; 0 failed\n");
        ExitCode::SUCCESS
    } else {
        println!("\ntest result: FAILED. 0 passed; 1 failed\n");
        ExitCode::from(101)
    }
}
