//! The connection's background tasks: lease requests, rail rebuilds, the control-channel
//! reader, each CQ's completion channel, the deadline timer, and ops handed to another backend.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use tensorwire_core::{Error, Result};
use tokio::io::unix::AsyncFd;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{oneshot, watch};

use crate::blob::RegionKeys;
use crate::control::{self};
use crate::shared::lock;
use crate::verbs::{Cq, Qp};
use crate::wire::{Msg, RailOffer};

use super::state::{After, ConnShared, Handed, LeaseData, LeaseKey, verbs};

/// Drives an op another backend took over, and delivers its result.
pub(super) async fn handed(
    conn: Weak<ConnShared>,
    id: u64,
    slot: Handed,
    tx: oneshot::Sender<Result<()>>,
) {
    let result = std::future::poll_fn(|cx| match lock(&slot.0).as_mut() {
        Some(c) => c.as_mut().poll(cx),
        None => Poll::Ready(Err(Error::PeerClosed("rdma: op cancelled".into()))),
    })
    .await;
    lock(&slot.0).take();
    if let Some(c) = conn.upgrade() {
        lock(&c.state).places.remove(&id);
    }
    let _ = tx.send(result);
}

/// Asks the target for a lease, then starts (or fails) the ops waiting for it.
pub(super) async fn ask_lease(conn: Weak<ConnShared>, key: LeaseKey, blob: Bytes) {
    let Some(c) = conn.upgrade() else { return };
    let limit = c.backend.cfg.answer_timeout;
    let LeaseKey { region, write, key: bits } = key;
    let asked = control::ask(&c.sender, &c.requests, limit, "lease answer", |req| Msg::Lease {
        req,
        region,
        key: tensorwire_core::AccessKey::from_bits(bits),
        write,
    })
    .await;
    let granted = match asked {
        Ok(Msg::Granted { len, bases, .. }) => {
            RegionKeys::decode(&blob).map(|keys| LeaseData { len, bases, keys, blob })
        }
        Ok(Msg::Refused { error, .. }) => Err(error),
        Ok(other) => {
            Err(Error::protocol(format!("rdma: lease answered with kind {}", other.kind())))
        }
        Err(e) => Err(e),
    };
    let now = Instant::now();
    let mut after = After::default();
    {
        let mut st = lock(&c.state);
        st.asked.remove(&key);
        let forgotten = st.forgotten.remove(&key);
        let waiting = st.waiting.remove(&key).unwrap_or_default();
        let mut out = Vec::new();
        match granted {
            Ok(data) if st.closed.is_none() => {
                let lease = Arc::new(data);
                st.leases.insert(key, (lease.clone(), 0));
                for ctx in waiting {
                    st.start(ctx, &lease, now, &mut out, &mut after);
                }
                if forgotten {
                    if let Some((_, users)) = st.leases.remove(&key) {
                        st.retire(key, users, &c.sender);
                    }
                }
            }
            Ok(_) => {
                let e = st.closed.clone().unwrap_or_else(|| Error::PeerClosed("closed".into()));
                for ctx in waiting {
                    st.places.remove(&ctx.id);
                    after.done.push((ctx, Err(e.clone())));
                }
            }
            Err(e) => {
                for ctx in waiting {
                    st.places.remove(&ctx.id);
                    after.done.push((ctx, Err(e.clone())));
                }
            }
        }
        c.run(&mut st, out, now, &mut after);
    }
    c.finish(after);
}

/// Replaces a rail's QP: a new one here, the target's new one there, connected.
pub(super) async fn rebuild(conn: Weak<ConnShared>, rail: usize) {
    let Some(c) = conn.upgrade() else { return };
    let made = async {
        let (nic, remote_nic) = {
            let st = lock(&c.state);
            (st.rails[rail].local_nic, st.rails[rail].remote_nic)
        };
        let cq = c
            .cqs
            .iter()
            .find(|(n, _)| *n == nic)
            .map(|(_, cq)| cq.clone())
            .ok_or_else(|| Error::Internal(format!("rdma: no CQ for NIC {nic}")))?;
        let n = &c.backend.nics[nic];
        let qp = n.create_qp(&cq, c.caps).map_err(verbs)?;
        qp.init().map_err(verbs)?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        let addr = n.info().address.qp(qp.qpn(), psn);
        let offer = RailOffer { local_nic: nic as u8, remote_nic, qp: addr };
        let limit = c.backend.cfg.answer_timeout;
        let m = control::ask(&c.sender, &c.requests, limit, "rail answer", |req| Msg::Rail {
            req,
            rail: rail as u16,
            offer,
        })
        .await?;
        match m {
            Msg::RailAck { answer: Ok(theirs), .. } => {
                qp.connect(psn, &theirs, &c.backend.cfg.timing).map_err(verbs)?;
                Ok(qp)
            }
            Msg::RailAck { answer: Err(e), .. } => Err(e),
            other => {
                Err(Error::protocol(format!("rdma: rail answered with kind {}", other.kind())))
            }
        }
    };
    let made: Result<Arc<dyn Qp>> = made.await;
    let now = Instant::now();
    let mut after = After { poke_timer: true, ..After::default() };
    {
        let mut st = lock(&c.state);
        let mut out = Vec::new();
        match made {
            Ok(qp) if st.closed.is_none() => {
                st.rails[rail].qp = qp;
                st.dispatch.rebuilt(rail, true, now, &mut out);
                tracing::debug!(rail, "rdma: rail rebuilt");
            }
            Ok(_) => st.dispatch.rebuilt(rail, false, now, &mut out),
            Err(e) => {
                tracing::debug!(rail, error = %e, "rdma: rail rebuild failed");
                st.dispatch.rebuilt(rail, false, now, &mut out);
            }
        }
        c.run(&mut st, out, now, &mut after);
    }
    c.finish(after);
}

/// Reads the target's messages: answers to requests, Forget, Bye.
pub(super) async fn reader(conn: Weak<ConnShared>, mut rd: OwnedReadHalf) {
    loop {
        let m = control::read::<Msg>(&mut rd).await;
        let Some(c) = conn.upgrade() else { return };
        match m {
            Ok(Some(m)) => match m {
                Msg::Granted { req, .. }
                | Msg::Refused { req, .. }
                | Msg::NotifyAck { req, .. }
                | Msg::RailAck { req, .. } => {
                    c.requests.answer(req, m);
                }
                Msg::Forget { region } => c.forget(region),
                Msg::Bye => {
                    c.close(Error::PeerClosed("rdma: the peer ended the connection".into()));
                    return;
                }
                other => {
                    c.close(Error::protocol(format!(
                        "rdma: unexpected message kind {} from the target",
                        other.kind()
                    )));
                    return;
                }
            },
            Ok(None) => {
                c.close(Error::PeerClosed("rdma: the peer closed the control channel".into()));
                return;
            }
            Err(e) => {
                c.close(e);
                return;
            }
        }
    }
}

/// A CQ's completion channel as tokio sees it.
pub(super) struct ChannelFd(Arc<dyn Cq>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.event_fd()
    }
}

/// Sleeps on a CQ's completion channel and feeds its completions to the connection.
pub(super) async fn poll_cq(
    conn: Weak<ConnShared>,
    cq: Arc<dyn Cq>,
    mut stop: watch::Receiver<()>,
) {
    // SAFETY: the descriptor is the CQ's completion channel, open for as long as the CQ lives,
    // and `ChannelFd` holds the CQ for the whole life of the `AsyncFd`.
    let registered = unsafe {
        AsyncFd::register_with_interest(ChannelFd(cq.clone()), tokio::io::Interest::READABLE)
    };
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(error = %e, "rdma: cannot watch a completion channel");
            return;
        }
    };
    loop {
        {
            let Some(c) = conn.upgrade() else { return };
            if let Err(e) = cq.arm() {
                tracing::error!(error = %e, "rdma: cannot arm a completion queue");
            }
            c.progress(&cq);
        }
        tokio::select! {
            ready = fd.readable() => match ready {
                Ok(mut g) => {
                    g.clear_ready();
                    let _ = cq.take_events();
                }
                Err(e) => {
                    tracing::error!(error = %e, "rdma: completion channel failed");
                    return;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// Ticks the dispatcher when a rail's pause ends (rebuilds rails).
pub(super) async fn timer(
    conn: Weak<ConnShared>,
    poke: Arc<tokio::sync::Notify>,
    mut stop: watch::Receiver<()>,
) {
    loop {
        let wake = {
            let Some(c) = conn.upgrade() else { return };
            let now = Instant::now();
            let mut after = After::default();
            let wake = {
                let mut st = lock(&c.state);
                let mut out = Vec::new();
                let w = st.dispatch.tick(now, &mut out);
                c.run(&mut st, out, now, &mut after);
                w
            };
            c.finish(after);
            wake
        };
        let sleep = async {
            match wake {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = poke.notified() => {}
            _ = stop.changed() => return,
        }
    }
}
