//! The target side of a connection: after the authenticated opening, one QP per offered rail
//! (connected to the initiator's, taking no requests of its own: the initiator's NIC reads and
//! writes through it), then leases checked by the engine, notifications delivered to it, and
//! rails rebuilt on request.
//!
//! The lease is what makes one-sided access follow the engine's rules: a peer learns a region's
//! addresses only after the engine checked region, key, permission and bounds, and the region
//! stays registered (the lease holds its in-flight gate) until the peer gives it back. The NIC
//! enforces the rest: an MR grants remote READ or WRITE only as the region's permissions say,
//! and a key whose MR was deregistered is refused.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use tensorwire_core::backend::RemoteRange;
use tensorwire_core::backend::kit::WeakList;
use tensorwire_core::{Error, Missing, RegionId, Result};
use tensorwire_core::{MemSlice, backend::Access};
use tensorwire_proto::admission::Pending;
use tokio::net::TcpStream;

use crate::NAME;
use crate::control::{self, Sender};
use crate::shared::{Shared, lock};
use crate::verbs::{Qp, QpAddress, QpCaps};
use crate::wire::{FRAMING, MAX_RAILS, Msg, RailOffer};

/// Leases one peer may hold at once.
const MAX_LEASES: usize = 1 << 16;

/// A peer's connection to this backend.
#[derive(Debug)]
pub(crate) struct InConn {
    sender: Sender,
    /// Leased regions, by (region, write access).
    leases: Mutex<HashMap<(RegionId, bool), MemSlice>>,
    /// The target's QP of each rail.
    qps: Mutex<Vec<Option<Arc<dyn Qp>>>>,
}

impl InConn {
    /// Whether the peer leases `region`.
    pub(crate) fn holds(&self, region: RegionId) -> bool {
        lock(&self.leases).keys().any(|(r, _)| *r == region)
    }

    /// Asks the peer to give `region` back.
    pub(crate) fn forget(&self, region: RegionId) {
        self.sender.send_later(Msg::Forget { region });
    }

    /// Takes `region` back whether the peer gave it back or not (its MRs are gone by now, so the
    /// peer's NIC can no longer reach it).
    pub(crate) fn revoke(&self, region: RegionId) {
        lock(&self.leases).retain(|(r, _), _| *r != region);
    }

    /// Ends the connection: its QPs and leases go.
    pub(crate) fn close(&self) {
        self.sender.send_later(Msg::Bye);
        lock(&self.qps).clear();
        lock(&self.leases).clear();
    }
}

/// Serves one peer until it leaves or fails.
/// Serves one peer's connection; the connection joins `inbound` once it is open.
pub(crate) async fn serve(
    shared: Weak<Shared>,
    inbound: Arc<WeakList<InConn>>,
    sock: TcpStream,
    peer: SocketAddr,
    mut pending: Pending,
) {
    if let Err(e) = run(&shared, &inbound, sock, peer, &mut pending).await {
        tracing::debug!(%peer, error = %e, "rdma: peer connection ended");
    }
    if let Some(s) = shared.upgrade() {
        s.released.notify_waiters();
    }
}

async fn run(
    shared: &Weak<Shared>,
    inbound: &WeakList<InConn>,
    mut sock: TcpStream,
    peer: SocketAddr,
    pending: &mut Pending,
) -> Result<()> {
    let (secret, limit) = {
        let s = up(shared)?;
        (s.host()?.cluster_secret(), s.cfg.answer_timeout)
    };
    control::accept(&mut sock, &FRAMING, secret.as_ref(), peer, limit, pending).await?;
    let (mut rd, wr) = sock.into_split();
    let first = tokio::time::timeout(limit, control::read::<Msg>(&mut rd))
        .await
        .map_err(|_| Error::timeout("rdma: waiting for Hello", limit))??;
    let Some(Msg::Hello { rails }) = first else {
        return Err(Error::protocol("rdma: a connection must open with Hello"));
    };
    let sender = Sender::start(wr);
    let conn = {
        let s = up(shared)?;
        let mut qps = Vec::with_capacity(rails.len());
        let mut answers = Vec::with_capacity(rails.len());
        for offer in &rails {
            match passive_qp(&s, offer) {
                Ok((qp, addr)) => {
                    qps.push(Some(qp));
                    answers.push(Ok(addr));
                }
                Err(e) => {
                    qps.push(None);
                    answers.push(Err(e));
                }
            }
        }
        let conn = Arc::new(InConn {
            sender: sender.clone(),
            leases: Mutex::new(HashMap::new()),
            qps: Mutex::new(qps),
        });
        inbound.push(&conn);
        sender.send(Msg::HelloAck { rails: answers }).await?;
        conn
    };
    loop {
        let Some(m) = control::read::<Msg>(&mut rd).await? else { return Ok(()) };
        let s = up(shared)?;
        match m {
            Msg::Lease { req, region, key, write } => {
                let answer = match lease(&s, &conn, region, key, write) {
                    Ok((len, bases)) => Msg::Granted { req, len, bases },
                    Err(error) => Msg::Refused { req, error },
                };
                sender.send(answer).await?;
            }
            Msg::Released { region, write } => {
                lock(&conn.leases).remove(&(region, write));
                s.released.notify_waiters();
            }
            Msg::Notify { req, msg } => {
                let error = s.host().and_then(|h| h.deliver(msg)).err();
                sender.send(Msg::NotifyAck { req, error }).await?;
            }
            Msg::Rail { req, rail, offer } => {
                let answer = rebuild(&s, &conn, rail, &offer);
                sender.send(Msg::RailAck { req, answer }).await?;
            }
            Msg::Bye => return Ok(()),
            other => {
                return Err(Error::protocol(format!(
                    "rdma: unexpected message kind {} from the initiator",
                    other.kind()
                )));
            }
        }
    }
}

fn up(shared: &Weak<Shared>) -> Result<Arc<Shared>> {
    shared.upgrade().ok_or_else(|| Error::PeerClosed("rdma backend dropped".into()))
}

/// The target's QP for one offered rail, connected to the initiator's.
fn passive_qp(s: &Shared, offer: &RailOffer) -> Result<(Arc<dyn Qp>, QpAddress)> {
    let verbs = |e: crate::verbs::VerbsError| Error::Backend { backend: NAME, source: Arc::new(e) };
    let i = offer.remote_nic as usize;
    let (nic, cq) = match (s.nics.get(i), s.passive_cqs.get(i)) {
        (Some(n), Some(c)) => (n, c),
        _ => return Err(Error::protocol(format!("rdma: a rail names NIC {i}, which is not here"))),
    };
    let qp = nic.create_qp(cq, QpCaps { max_send_wr: 1, max_sge: 1 }).map_err(verbs)?;
    qp.init().map_err(verbs)?;
    let psn = rand::random::<u32>() & 0x00ff_ffff;
    qp.connect(psn, &offer.qp, &s.cfg.timing).map_err(verbs)?;
    let addr = nic.info().address.qp(qp.qpn(), psn);
    Ok((qp, addr))
}

fn rebuild(
    s: &Shared,
    conn: &InConn,
    rail: u16,
    offer: &RailOffer,
) -> std::result::Result<QpAddress, Error> {
    let mut qps = lock(&conn.qps);
    let Some(slot) = qps.get_mut(rail as usize).filter(|_| (rail as usize) < MAX_RAILS) else {
        return Err(Error::protocol(format!("rdma: rebuild of unknown rail {rail}")));
    };
    let (qp, addr) = passive_qp(s, offer)?;
    *slot = Some(qp);
    Ok(addr)
}

/// Checks a lease through the engine and holds the region: its length and addresses.
fn lease(
    s: &Shared,
    conn: &InConn,
    region: RegionId,
    key: tensorwire_core::AccessKey,
    write: bool,
) -> Result<(u64, Vec<(u8, u64)>)> {
    let host = s.host()?;
    let access = if write { Access::Write } else { Access::Read };
    let local = s.region(region);
    let len = local.as_ref().map_or(0, |r| r.len);
    let whole = host.resolve(RemoteRange { region, key, offset: 0, len }, access)?;
    let Some(local) = local else {
        return Err(Error::Unsupported {
            backend: NAME,
            what: format!("region {} is not registered with this engine's RDMA NICs", region.0),
        });
    };
    let mut leases = lock(&conn.leases);
    if leases.len() >= MAX_LEASES && !leases.contains_key(&(region, write)) {
        return Err(Error::Capacity {
            what: "rdma leases held by one peer".into(),
            requested: leases.len() as u64 + 1,
            limit: MAX_LEASES as u64,
        });
    }
    leases.insert((region, write), whole);
    // Checked with the lease held: a deregistration that began before this saw no lease of
    // ours and will not ask it back, so it is not granted.
    if local.closing.load(Ordering::SeqCst) {
        leases.remove(&(region, write));
        return Err(Error::NotFound(Missing::Deregistered(region)));
    }
    Ok((local.len, local.bases()))
}
