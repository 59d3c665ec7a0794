//! `tensorwire-etcd`: the cluster on etcd, for deployments beyond one host.
//!
//! - [`EtcdDiscovery`]: the [`tensorwire_proto::discovery::Discovery`] registry in etcd. Entries
//!   live under `/tensorwire/<cluster>/reg/<kind>/<id>`, each attached to its process's lease,
//!   kept alive in the background: when the process dies, the lease runs out and the entry goes;
//!   watchers see joins and departures.
//! - [`Leadership`] and [`leader_resolver`]: orchestrators of a cluster campaign through etcd's
//!   election API; one leads, the others wait as standbys. Clients resolve the leader's address
//!   at every (re)connection, so they follow a new leader by themselves.
//! - [`EtcdJournal`]: the leader's journal in etcd (one key per committed turn, written only
//!   while it still leads), from which a new leader rebuilds the queues.
//! - [`testing::EtcdServer`]: a throwaway etcd on loopback ports for tests.
//!
//! Nothing secret is ever written to etcd: no region keys, no pool keys, no cluster secret.
//!
//! The etcd client is behind the cargo feature `etcd` (it builds its protocol with `protoc`:
//! Debian's `protobuf-compiler`); without it this crate has only [`testing`] and [`ENABLED`]
//! says so.

// Without the `etcd` feature the items these docs link to are not built.
#![cfg_attr(not(feature = "etcd"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "etcd")]
mod discovery;
#[cfg(feature = "etcd")]
mod election;
#[cfg(feature = "etcd")]
mod journal;
#[cfg(feature = "etcd")]
mod lease;
pub mod testing;

#[cfg(feature = "etcd")]
pub use discovery::EtcdDiscovery;
#[cfg(feature = "etcd")]
pub use election::{Leadership, leader_addr, leader_resolver};
/// The etcd client (re-exported so users need no direct dependency).
#[cfg(feature = "etcd")]
pub use etcd_client::Client as EtcdClient;
#[cfg(feature = "etcd")]
pub use journal::EtcdJournal;

/// Whether this build talks to etcd (the `etcd` feature).
pub const ENABLED: bool = cfg!(feature = "etcd");

/// Why an etcd option cannot be used in this build.
pub const DISABLED: &str = "this build has no etcd support: build with the cargo feature `etcd` \
     (e.g. `cargo build --release --features tensorwire-cli/etcd`), which needs protoc \
     (Debian: apt-get install protobuf-compiler)";

/// Every key of `cluster` starts with this.
pub fn cluster_prefix(cluster: &str) -> String {
    format!("/tensorwire/{cluster}/")
}

#[cfg(feature = "etcd")]
/// Connects to etcd at `endpoints` (e.g. `http://127.0.0.1:2379`), within `timeout`.
pub async fn connect(
    endpoints: &[String],
    timeout: std::time::Duration,
) -> tensorwire_core::Result<etcd_client::Client> {
    let opts =
        etcd_client::ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
    let c = tokio::time::timeout(timeout, etcd_client::Client::connect(endpoints, Some(opts)))
        .await
        .map_err(|_| tensorwire_core::Error::timeout(format!("etcd at {endpoints:?}"), timeout))?;
    c.map_err(|e| err("connect", e))
}

/// An etcd failure as a core error.
#[cfg(feature = "etcd")]
pub(crate) fn err(what: &str, e: etcd_client::Error) -> tensorwire_core::Error {
    tensorwire_core::Error::PeerClosed(format!("etcd: {what}: {e}"))
}
