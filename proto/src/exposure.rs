//! Secure by default: a listener other hosts can reach must authenticate its peers. Bound to a
//! loopback address, an endpoint without a cluster secret is fine (tests, one host); bound to
//! any other address (including 0.0.0.0) it is refused at start unless it has a secret or the
//! operator opted out explicitly (`insecure`), which is logged at start and for every peer.

use std::net::SocketAddr;

use crate::auth::ClusterSecret;
use crate::error::{Error, Result};

/// Whether a listener on `addr` can be reached from other hosts (anything but loopback).
pub fn is_exposed(addr: SocketAddr) -> bool {
    !addr.ip().is_loopback()
}

/// Refuses to start `what` on `listen` when other hosts could reach it and it has no cluster
/// secret, unless `insecure` opts out (then it warns).
pub fn check_listener(
    what: &str,
    listen: SocketAddr,
    secret: Option<&ClusterSecret>,
    insecure: bool,
) -> Result<()> {
    if secret.is_some() || !is_exposed(listen) {
        return Ok(());
    }
    if insecure {
        tracing::warn!(
            %listen,
            "{what} accepts unauthenticated peers from other hosts (insecure): anyone who \
             reaches it can read and overwrite the memory it shows to peers"
        );
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{what} on {listen} would accept any peer from other hosts: give it a cluster secret \
         (a file made by `tensorwire secret new FILE`, then `--secret-file FILE` or \
         `cluster_secret`), bind a loopback address, or opt out with `--insecure` / \
         `insecure: true`"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exposed_listeners_without_a_secret_are_refused() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let k = ClusterSecret::new("k");
        for open in ["0.0.0.0:7000", "10.0.0.5:7000", "[::]:7000"] {
            let e = check_listener("x", at(open), None, false).unwrap_err().to_string();
            assert!(e.contains("tensorwire secret new") && e.contains("--insecure"), "{e}");
            check_listener("x", at(open), Some(&k), false).unwrap();
            check_listener("x", at(open), None, true).unwrap();
        }
        for local in ["127.0.0.1:7000", "127.9.9.9:0", "[::1]:7000"] {
            check_listener("x", at(local), None, false).unwrap();
        }
    }
}
