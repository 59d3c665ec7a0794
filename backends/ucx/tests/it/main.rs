//! The integration tests of `tensorwire-ucx`, in one test binary: a module per concern. Built
//! without the `ucx` feature there is nothing to run, and the one test left says so (ignored).

#[cfg(feature = "ucx")]
mod allocated;
#[cfg(feature = "ucx")]
mod conformance;
#[cfg(feature = "ucx")]
mod exit;
#[cfg(feature = "ucx")]
mod peer_killed;
#[cfg(feature = "ucx")]
mod two_process;
#[cfg(feature = "ucx")]
mod two_process_tcp;

#[cfg(feature = "ucx")]
tensorwire_conformance::children! {
    "engine-sm" => two_process::child,
    "engine-tcp" => two_process_tcp::child,
    "exit" => exit::exit_child,
    "peer" => peer_killed::peer_child,
}

#[cfg(not(feature = "ucx"))]
#[test]
#[ignore = "built without the `ucx` feature: cargo test -p tensorwire-ucx --features ucx"]
fn ucx_tests_need_the_ucx_feature() {}
