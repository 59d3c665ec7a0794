//! The target side, on the progress thread: a peer's Hello opens a reverse endpoint for answers;
//! each Begin is checked by the engine (`BackendHost::resolve`: existence, key, permission,
//! bounds) and, when granted, the resolved slice is held (the region's in-flight gate stays
//! open, so deregistration waits) until the peer's End; notifications go to the engine.
//!
//! A Begin that asks for a lease, and may have one (the whole region resolves for its access),
//! holds the whole region for the connection: the peer runs later ops on it with no Begin. When
//! the region is deregistered the peer is told (Forget) and the lease is held until its Released,
//! sent once its ops on it are over.
//!
//! The grant is what makes one-sided access safe here: a peer learns the address of a range only
//! after the check, moves bytes only inside it, and the range stays registered until End. The
//! packed key alone (in the region's blob) grants nothing to a peer that follows this protocol;
//! UCX transports themselves enforce no tensorwire permission (see the crate docs).

use std::collections::HashMap;

use bytes::Bytes;
use tensorwire_core::backend::kit::encode_error;
use tensorwire_core::{Error, Result};
use tensorwire_core::{MemSlice, backend::Access};

use crate::conns::{Hold, InConn};
use crate::progress::Progress;
use crate::tokens::INBOUND;
use crate::wire::{Kind, LEASE, Msg, OK, WRITE};

/// Regions one peer may hold at once (Begin without End).
const MAX_HOLDS: usize = 1 << 16;

impl Progress {
    pub(crate) fn hello(&mut self, msg: &Msg<'_>) {
        if self.stopping.is_some() || self.inb.contains_key(&msg.conn) {
            return;
        }
        let token = msg.conn | INBOUND;
        let ep = match self.worker.connect(msg.body, token, self.cfg.peer_failure_detection) {
            Ok(ep) => ep,
            Err(e) => {
                tracing::warn!(error = %e, "ucx: cannot reach a peer that said hello");
                return;
            }
        };
        let ack = Msg { flags: OK, ..Msg::new(Kind::HelloAck, msg.conn, msg.req) };
        if let Err(e) = self.tokens.send(&ep, token, &ack) {
            tracing::warn!(error = %e, "ucx: cannot answer a hello");
            return;
        }
        self.inb.insert(msg.conn, InConn { holds: HashMap::new(), leases: HashMap::new(), ep });
    }

    fn check(&self, msg: &Msg<'_>, held: usize) -> Result<MemSlice> {
        if self.stopping.is_some() {
            return Err(Error::PeerClosed("ucx backend shutting down".into()));
        }
        if held >= MAX_HOLDS {
            return Err(Error::Capacity {
                what: "ucx regions held by one peer".into(),
                requested: held as u64 + 1,
                limit: MAX_HOLDS as u64,
            });
        }
        let host =
            self.host.as_ref().ok_or_else(|| Error::PeerClosed("ucx: not attached".into()))?;
        let access = if msg.flags & WRITE != 0 { Access::Write } else { Access::Read };
        host.resolve(msg.range(), access)
    }

    pub(crate) fn begin(&mut self, msg: &Msg<'_>) {
        let Some(held) = self.inb.get(&msg.conn).map(|c| c.holds.len()) else {
            tracing::warn!(conn = msg.conn, "ucx: Begin on an unknown connection");
            return;
        };
        let checked = self.check(msg, held);
        let write = msg.flags & WRITE != 0;
        let wanted = msg.flags & LEASE != 0
            && self
                .inb
                .get(&msg.conn)
                .is_some_and(|c| !c.leases.contains_key(&(msg.region, write)));
        // The lease: the whole region, checked the same way for this access.
        let lease = match (&checked, wanted, self.lengths.get(&msg.region)) {
            (Ok(_), true, Some(&len)) if len > 0 => {
                self.check(&Msg { offset: 0, len, ..*msg }, held).ok()
            }
            _ => None,
        };
        let memh = self.regions.get(&msg.region).cloned();
        let Some(c) = self.inb.get_mut(&msg.conn) else { return };
        let (answer, err);
        match (checked, lease) {
            (Ok(_), Some(whole)) => {
                answer = Msg {
                    flags: OK | LEASE,
                    region: msg.region,
                    offset: whole.ptr() as u64,
                    len: whole.len(),
                    ..Msg::new(Kind::Granted, msg.conn, msg.req)
                };
                c.leases.insert((msg.region, write), Hold { slice: whole, memh });
            }
            (Ok(slice), None) => {
                answer = Msg {
                    flags: OK,
                    region: msg.region,
                    offset: slice.ptr() as u64,
                    len: msg.len,
                    ..Msg::new(Kind::Granted, msg.conn, msg.req)
                };
                c.holds.insert(msg.req, Hold { slice, memh });
            }
            (Err(e), _) => {
                err = encode_error(&e);
                answer = Msg {
                    region: msg.region,
                    body: &err,
                    ..Msg::new(Kind::Granted, msg.conn, msg.req)
                };
            }
        }
        if let Err(e) = self.tokens.send(&c.ep, msg.conn | INBOUND, &answer) {
            tracing::warn!(error = %e, "ucx: cannot answer a Begin");
            self.drop_inbound(msg.conn, &e);
        }
    }

    pub(crate) fn end(&mut self, msg: &Msg<'_>) {
        if let Some(c) = self.inb.get_mut(&msg.conn) {
            c.holds.remove(&msg.req);
        }
    }

    /// A peer's lease is over (its ops on it are flushed): the region goes back.
    pub(crate) fn released(&mut self, msg: &Msg<'_>) {
        if let Some(c) = self.inb.get_mut(&msg.conn) {
            let had = c.leases.remove(&(msg.region, msg.flags & WRITE != 0)).is_some();
            if had && c.leases.is_empty() && self.stopping.is_some() {
                // Shutting down: its last lease is back (see `begin_shutdown`).
                self.say_bye_as_target(msg.conn);
            }
        }
    }

    /// `region` is being deregistered: every peer leasing it is told to give it back.
    pub(crate) fn forget(&mut self, region: tensorwire_core::RegionId) {
        for (&conn, c) in &self.inb {
            if c.leases.keys().any(|(r, _)| *r == region) {
                let m = Msg { region, ..Msg::new(Kind::Forget, conn, 0) };
                if let Err(e) = self.tokens.send(&c.ep, conn | INBOUND, &m) {
                    tracing::warn!(error = %e, "ucx: cannot tell a peer a region is going");
                }
            }
        }
    }

    pub(crate) fn notified(&mut self, msg: &Msg<'_>) {
        let Some(c) = self.inb.get(&msg.conn) else { return };
        let delivered = match &self.host {
            Some(h) => h.deliver(Bytes::copy_from_slice(msg.body)),
            None => Err(Error::PeerClosed("ucx: not attached".into())),
        };
        let err;
        let ack = match delivered {
            Ok(()) => Msg { flags: OK, ..Msg::new(Kind::NotifyAck, msg.conn, msg.req) },
            Err(e) => {
                err = encode_error(&e);
                Msg { body: &err, ..Msg::new(Kind::NotifyAck, msg.conn, msg.req) }
            }
        };
        if let Err(e) = self.tokens.send(&c.ep, msg.conn | INBOUND, &ack) {
            tracing::warn!(error = %e, "ucx: cannot answer a notification");
        }
    }

    /// Forgets a peer's connection and closes its endpoint. Ranges it still held go to the
    /// graveyard, not back to their regions: a peer that left mid-op (or UCX on its behalf) may
    /// still deliver queued puts into them.
    pub(crate) fn drop_inbound(&mut self, conn: u64, why: &Error) {
        if let Some(c) = self.inb.remove(&conn) {
            tracing::debug!(conn, held = c.holds.len(), reason = %why, "ucx: peer connection over");
            for hold in c.holds.into_values().chain(c.leases.into_values()) {
                hold.bury(&mut self.graveyard);
            }
        }
    }
}
