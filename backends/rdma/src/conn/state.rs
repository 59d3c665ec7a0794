//! A connection's state, under its lock: leases, ops and where each is, the rails; and the
//! shared part the IO shell, the setup and the background tasks all reach.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tensorwire_core::backend::{Completion, Op};
use tensorwire_core::{Error, RegionId, Result};
use tokio::sync::{oneshot, watch};

use crate::NAME;
use crate::blob::RegionKeys;
use crate::control::{Requests, Sender};
use crate::dispatch::{Action, Dispatch, OpKey};
use crate::region::LocalRegion;
use crate::shared::Shared;
use crate::verbs::{Cq, Qp, QpCaps, VerbsError};
use crate::wire::Msg;

pub(super) fn verbs(e: VerbsError) -> Error {
    Error::Backend { backend: NAME, source: Arc::new(e) }
}

/// A lease: a region, with write access or not, under one access key (its bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct LeaseKey {
    pub(super) region: RegionId,
    pub(super) write: bool,
    pub(super) key: u128,
}

/// What a granted lease says of the remote region, with the NIC keys of the blob it was asked
/// with (an op with another blob gets its own keys).
#[derive(Debug)]
pub(super) struct LeaseData {
    pub(super) len: u64,
    pub(super) bases: Vec<(u8, u64)>,
    pub(super) keys: RegionKeys,
    pub(super) blob: Bytes,
}

impl LeaseData {
    pub(super) fn base(&self, nic: u8) -> Option<u64> {
        self.bases.iter().find(|(n, _)| *n == nic).map(|&(_, b)| b)
    }
}

/// An op as the connection keeps it. Field order matters: the local registration (its MRs)
/// drops before the op, whose slice keeps the memory.
#[derive(Debug)]
pub(crate) struct OpCtx {
    pub(super) local: Arc<LocalRegion>,
    pub(super) lease: Option<Arc<LeaseData>>,
    pub(super) op: Op,
    pub(super) id: u64,
    pub(super) key: LeaseKey,
    pub(super) tx: oneshot::Sender<Result<()>>,
}

/// A rail's IO side.
#[derive(Debug)]
pub(super) struct RailIo {
    pub(super) local_nic: usize,
    pub(super) remote_nic: u8,
    pub(super) qp: Arc<dyn Qp>,
}

/// The completion slot of an op handed to another backend (dropped to cancel it).
#[derive(Clone)]
pub(super) struct Handed(pub(super) Arc<Mutex<Option<Completion>>>);

impl std::fmt::Debug for Handed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handed(..)")
    }
}

/// Where an op is.
#[derive(Debug, Clone)]
pub(super) enum Place {
    Waiting(LeaseKey),
    Dispatch(OpKey),
    Handed(Handed),
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) dispatch: Dispatch<OpCtx>,
    pub(super) rails: Vec<RailIo>,
    pub(super) leases: HashMap<LeaseKey, (Arc<LeaseData>, u32)>,
    /// Leases the target asked back, with their ops still running.
    pub(super) retiring: HashMap<LeaseKey, u32>,
    pub(super) asked: HashSet<LeaseKey>,
    /// Leases asked for whose region the target asked back before its grant arrived (the
    /// target sends `Forget` as soon as it holds the lease, and the grant may come after it):
    /// the grant serves the ops that waited for it and then goes back, never cached.
    pub(super) forgotten: HashSet<LeaseKey>,
    pub(super) waiting: HashMap<LeaseKey, Vec<OpCtx>>,
    pub(super) places: HashMap<u64, Place>,
    pub(super) closed: Option<Error>,
    pub(super) next_id: u64,
}

/// What is left to do once the lock is released.
#[derive(Debug, Default)]
pub(super) struct After {
    pub(super) done: Vec<(OpCtx, Result<()>)>,
    pub(super) handed: Vec<(OpCtx, Error, Handed)>,
    pub(super) rebuild: Vec<usize>,
    pub(super) ask: Vec<(LeaseKey, Bytes)>,
    pub(super) poke_timer: bool,
}

/// One connection's shared state.
#[derive(Debug)]
pub(crate) struct ConnShared {
    pub(super) backend: Arc<Shared>,
    pub(super) sender: Sender,
    pub(super) requests: Arc<Requests>,
    /// One CQ per local NIC used (by NIC index).
    pub(super) cqs: Vec<(usize, Arc<dyn Cq>)>,
    pub(super) state: Mutex<State>,
    pub(super) timer: Arc<tokio::sync::Notify>,
    /// Dropped with the connection: its tasks end.
    pub(super) _stop: watch::Sender<()>,
    pub(super) stop_rx: watch::Receiver<()>,
    pub(super) caps: QpCaps,
}

impl State {
    /// Starts a leased op in the dispatcher (or ends it at once: out of bounds, no rail).
    pub(super) fn start(
        &mut self,
        mut ctx: OpCtx,
        lease: &Arc<LeaseData>,
        now: Instant,
        out: &mut Vec<Action<OpCtx>>,
        after: &mut After,
    ) {
        let (offset, len) = (ctx.op.remote().offset, ctx.op.local().len());
        if offset.checked_add(len).is_none_or(|end| end > lease.len) {
            let e = Error::OutOfBounds {
                what: format!("remote region {}", ctx.op.remote().region.0),
                offset,
                len,
                limit: lease.len,
            };
            self.places.remove(&ctx.id);
            after.done.push((ctx, Err(e)));
            return;
        }
        let lease = if ctx.op.remote().blob == lease.blob {
            lease.clone()
        } else {
            // Another blob for the same region and key: its own NIC keys, the lease's addresses.
            match RegionKeys::decode(&ctx.op.remote().blob) {
                Ok(keys) => Arc::new(LeaseData {
                    len: lease.len,
                    bases: lease.bases.clone(),
                    keys,
                    blob: ctx.op.remote().blob.clone(),
                }),
                Err(e) => {
                    self.places.remove(&ctx.id);
                    after.done.push((ctx, Err(e)));
                    return;
                }
            }
        };
        let local_nics = ctx.local.on();
        let (mut allowed, mut preferred) = (0u64, 0u64);
        for (i, r) in self.rails.iter().enumerate() {
            let here = local_nics & (1 << r.local_nic) != 0;
            let there = lease.keys.on(r.remote_nic).is_some() && lease.base(r.remote_nic).is_some();
            if here && there {
                allowed |= 1 << i;
                if ctx.local.preferred & (1 << r.local_nic) != 0 {
                    preferred |= 1 << i;
                }
            }
        }
        if let Some(e) = self.leases.get_mut(&ctx.key) {
            e.1 += 1;
        }
        ctx.lease = Some(lease.clone());
        let id = ctx.id;
        let k = self.dispatch.submit(ctx, len, allowed, preferred, now, out);
        self.places.insert(id, Place::Dispatch(k));
    }

    /// A lease the target asked back: given back now if no op uses it, else once the last ends.
    pub(super) fn retire(&mut self, key: LeaseKey, users: u32, sender: &Sender) {
        if users == 0 {
            sender.send_later(Msg::Released { region: key.region, write: key.write });
        } else {
            self.retiring.insert(key, users);
        }
    }

    /// An op left: its lease has one user less (a retiring lease is given back at zero).
    pub(super) fn release(&mut self, key: &LeaseKey, sender: &Sender) {
        if let Some(e) = self.leases.get_mut(key) {
            e.1 = e.1.saturating_sub(1);
        } else if let Some(n) = self.retiring.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.retiring.remove(key);
                sender.send_later(Msg::Released { region: key.region, write: key.write });
            }
        }
    }
}
