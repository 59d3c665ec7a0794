//! The target side, on the progress thread: a peer's Hello opens a reverse endpoint for answers;
//! each Begin is checked by the engine (`BackendHost::resolve`: existence, key, permission,
//! bounds) and, when granted, the resolved slice is held (the region's in-flight gate stays
//! open, so deregistration waits) until the peer's End; notifications go to the engine.
//!
//! The grant is what makes one-sided access safe here: a peer learns the address of a range only
//! after the check, moves bytes only inside it, and the range stays registered until End. The
//! packed key alone (in the region's blob) grants nothing to a peer that follows this protocol;
//! UCX transports themselves enforce no tensorwire permission (see the crate docs).

use std::collections::HashMap;
use std::rc::Rc;

use bytes::Bytes;
use tensorwire_core::backend::kit::encode_error;
use tensorwire_core::region::{Access, MemSlice};
use tensorwire_core::{Error, Result};

use crate::ffi::{Endpoint, MemHandle};
use crate::progress::{Graveyard, INBOUND, Progress};
use crate::wire::{Kind, Msg, OK, WRITE};

/// Regions one peer may hold at once (Begin without End).
const MAX_HOLDS: usize = 1 << 16;

/// A region range a peer was granted, held until its End.
#[derive(Debug)]
pub(crate) struct Hold {
    slice: MemSlice,
    memh: Option<Rc<MemHandle>>,
}

impl Hold {
    /// Keeps the range for puts the peer may still have queued (see [`Graveyard`]).
    pub(crate) fn bury(self, graveyard: &mut Graveyard) {
        graveyard.bury(self.slice, self.memh, None);
    }
}

/// A peer's connection to this backend.
#[derive(Debug)]
pub(crate) struct InConn {
    pub(crate) holds: HashMap<u64, Hold>,
    pub(crate) ep: Endpoint,
}

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
        self.inb.insert(msg.conn, InConn { holds: HashMap::new(), ep });
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
        let memh = self.regions.get(&msg.region).cloned();
        let Some(c) = self.inb.get_mut(&msg.conn) else { return };
        let (answer, err);
        match checked {
            Ok(slice) => {
                answer = Msg {
                    flags: OK,
                    region: msg.region,
                    offset: slice.ptr() as u64,
                    len: msg.len,
                    ..Msg::new(Kind::Granted, msg.conn, msg.req)
                };
                c.holds.insert(msg.req, Hold { slice, memh });
            }
            Err(e) => {
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
            for (_, hold) in c.holds {
                hold.bury(&mut self.graveyard);
            }
        }
    }
}
