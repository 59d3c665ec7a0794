//! Leadership of a cluster's orchestrator through etcd's election API: candidates campaign on
//! `/tensorwire/<cluster>/orchestrator-leader` with their address as the value; the elected one
//! serves until its lease is lost; clients resolve the current leader's value.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use tensorwire_orchestrator::service::Resolver;

use crate::lease::Lease;
use crate::{cluster_prefix, err};

fn election(cluster: &str) -> String {
    format!("{}orchestrator-leader", cluster_prefix(cluster))
}

/// This process leads its cluster's orchestrators.
#[derive(Debug)]
pub struct Leadership {
    lease: Lease,
    key: Vec<u8>,
    rev: i64,
}

impl Leadership {
    /// Campaigns with `addr` as this candidate's value; returns once elected (waiting as a
    /// standby while another leads). The candidacy lives on a lease of `ttl`: a leader that
    /// dies is replaced at most `ttl` later.
    pub async fn campaign(
        client: &Client,
        cluster: &str,
        addr: SocketAddr,
        ttl: Duration,
    ) -> tensorwire_core::Result<Leadership> {
        let lease = Lease::grant(client, ttl).await?;
        let mut c = client.clone();
        let r = tokio::select! {
            r = c.campaign(election(cluster), addr.to_string(), lease.id()) => {
                r.map_err(|e| err("campaign", e))?
            }
            _ = lease.lost() => {
                return Err(tensorwire_core::Error::PeerClosed(
                    "etcd: the candidacy's lease was lost while campaigning".into(),
                ));
            }
        };
        let leader = r.leader().ok_or_else(|| {
            tensorwire_core::Error::protocol("etcd: campaign answered without a leader key")
        })?;
        Ok(Leadership { key: leader.key().to_vec(), rev: leader.rev(), lease })
    }

    /// What a leader's writes are conditioned on: its election key and that key's creation
    /// revision (gone or different once another leads).
    pub fn guard(&self) -> (Vec<u8>, i64) {
        (self.key.clone(), self.rev)
    }

    /// Resolves once leadership is lost (the lease could not be kept alive).
    pub async fn lost(&self) {
        self.lease.lost().await;
    }
}

/// The current leader's address, if there is one.
pub async fn leader_addr(client: &Client, cluster: &str) -> Option<SocketAddr> {
    let r = client.clone().leader(election(cluster)).await.ok()?;
    std::str::from_utf8(r.kv()?.value()).ok()?.parse().ok()
}

/// A resolver for the orchestrator clients: the current leader at every (re)connection.
pub fn leader_resolver(client: Client, cluster: &str) -> Resolver {
    let cluster = cluster.to_string();
    Arc::new(move || {
        let (c, cluster) = (client.clone(), cluster.clone());
        Box::pin(async move { leader_addr(&c, &cluster).await })
    })
}
