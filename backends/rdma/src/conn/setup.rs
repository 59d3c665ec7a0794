//! Setting a connection up: the NICs paired with the peer's, a QP per rail, the Hello
//! exchange, and the background tasks started.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tensorwire_core::backend::PeerBackendInfo;
use tensorwire_core::{Error, Result};
use tokio::sync::watch;

use crate::NAME;
use crate::blob::Endpoint;
use crate::control::{self, Requests, Sender};
use crate::dispatch::Dispatch;
use crate::shared::Shared;
use crate::verbs::{Cq, QpCaps};
use crate::wire::{Msg, RailOffer};

use super::state::{ConnShared, RailIo, State, verbs};
use super::tasks::{poll_cq, reader, timer};

/// NIC pairs: each local NIC with a reachable peer NIC (spread over the reachable ones).
pub(super) fn pair(local: &[crate::verbs::NicInfo], remote: &Endpoint) -> Vec<(usize, u8)> {
    let mut pairs = Vec::new();
    for (i, l) in local.iter().enumerate() {
        let reach: Vec<u8> = remote
            .nics
            .iter()
            .enumerate()
            .filter(|(_, r)| r.reachable_from(l))
            .map(|(j, _)| j as u8)
            .collect();
        if !reach.is_empty() {
            pairs.push((i, reach[i % reach.len()]));
        }
    }
    pairs
}

/// Opens a connection to `peer` (see the module docs).
pub(crate) async fn connect(s: &Arc<Shared>, peer: &PeerBackendInfo) -> Result<Arc<ConnShared>> {
    let ep = Endpoint::decode(&peer.endpoint)?;
    let pairs = pair(&s.infos, &ep);
    if pairs.is_empty() {
        return Err(Error::Unsupported {
            backend: NAME,
            what: format!(
                "no NIC here reaches a NIC of {} (fabrics here {:x?}, there {:x?})",
                peer.engine,
                s.infos.iter().map(|n| n.address.fabric).collect::<Vec<_>>(),
                ep.nics.iter().map(|n| n.fabric).collect::<Vec<_>>()
            ),
        });
    }
    let host = s.host()?;
    let limit = s.cfg.answer_timeout;
    let sock = control::dial(ep.control, host.cluster_secret().as_ref(), limit).await?;
    let per_nic = s.cfg.qps_per_nic.clamp(1, crate::dispatch::MAX_CONN_RAILS / pairs.len().max(1));
    let window = s.cfg.data_path.window;
    let caps = QpCaps { max_send_wr: window + 4, max_sge: 1 };
    let mut cqs: Vec<(usize, Arc<dyn Cq>)> = Vec::new();
    for &(l, _) in &pairs {
        let depth = (per_nic as u32) * caps.max_send_wr * 2 + 64;
        cqs.push((l, s.nics[l].create_cq(depth).map_err(verbs)?));
    }
    let mut rails = Vec::new();
    let mut offers = Vec::new();
    for (&(l, r), (_, cq)) in pairs.iter().zip(&cqs) {
        for _ in 0..per_nic {
            let qp = s.nics[l].create_qp(cq, caps).map_err(verbs)?;
            qp.init().map_err(verbs)?;
            let psn = rand::random::<u32>() & 0x00ff_ffff;
            let addr = s.nics[l].info().address.qp(qp.qpn(), psn);
            offers.push(RailOffer { local_nic: l as u8, remote_nic: r, qp: addr });
            rails.push((l, r, qp, psn));
        }
    }
    let (mut rd, mut wr) = sock.into_split();
    let hello = async {
        control::write(&mut wr, &Msg::Hello { rails: offers }).await?;
        control::read::<Msg>(&mut rd).await
    };
    let answer = tokio::time::timeout(limit, hello)
        .await
        .map_err(|_| Error::timeout(format!("rdma: setup with {}", peer.engine), limit))??;
    let Some(Msg::HelloAck { rails: answers }) = answer else {
        return Err(Error::protocol("rdma: the peer did not answer Hello with HelloAck"));
    };
    if answers.len() != rails.len() {
        return Err(Error::protocol(format!(
            "rdma: {} rails offered, {} answered",
            rails.len(),
            answers.len()
        )));
    }
    let mut up = Vec::new();
    for ((l, r, qp, psn), a) in rails.into_iter().zip(answers) {
        let connected = a.and_then(|addr| qp.connect(psn, &addr, &s.cfg.timing).map_err(verbs));
        match connected {
            Ok(()) => up.push(RailIo { local_nic: l, remote_nic: r, qp }),
            Err(e) => {
                tracing::warn!(nic = %s.infos[l].address.name, error = %e, "rdma: a rail could not be set up")
            }
        }
    }
    if up.is_empty() {
        return Err(Error::Unsupported {
            backend: NAME,
            what: format!("no rail to {} could be set up", peer.engine),
        });
    }
    let cfg = s.cfg.data_path;
    let (stop, stop_rx) = watch::channel(());
    let conn = Arc::new(ConnShared {
        backend: s.clone(),
        sender: Sender::start(wr),
        requests: Arc::new(Requests::default()),
        cqs,
        state: Mutex::new(State {
            dispatch: Dispatch::new(cfg, up.len()),
            rails: up,
            leases: HashMap::new(),
            retiring: HashMap::new(),
            asked: HashSet::new(),
            forgotten: HashSet::new(),
            waiting: HashMap::new(),
            places: HashMap::new(),
            closed: None,
            next_id: 0,
        }),
        timer: Arc::new(tokio::sync::Notify::new()),
        _stop: stop,
        stop_rx,
        caps,
    });
    tokio::spawn(reader(Arc::downgrade(&conn), rd));
    for (_, cq) in &conn.cqs {
        tokio::spawn(poll_cq(Arc::downgrade(&conn), cq.clone(), conn.stop_rx.clone()));
    }
    tokio::spawn(timer(Arc::downgrade(&conn), conn.timer.clone(), conn.stop_rx.clone()));
    Ok(conn)
}
