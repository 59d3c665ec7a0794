//! What the progress thread's pending UCX requests stand for ([`Token`], [`Tokens`]), what
//! abandoned requests may still touch ([`Graveyard`]), and one op handed to the thread
//! ([`Submitted`]).

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use tensorwire_core::MemSlice;
use tensorwire_core::Result;
use tensorwire_core::backend::Op;
use tensorwire_core::backend::kit::DetachedMemory;
use tokio::sync::oneshot;

use crate::ffi::{Endpoint, MemHandle, RemoteKey, Started};
use crate::gate::OpGate;
use crate::wire::Msg;

/// Endpoint tokens with this bit belong to inbound connections.
pub(crate) const INBOUND: u64 = 1 << 63;

/// One op handed to the thread.
#[derive(Debug)]
pub(crate) struct Submitted {
    pub(crate) op: Op,
    pub(crate) gate: Arc<OpGate>,
    pub(crate) done: oneshot::Sender<Result<()>>,
}

/// What a pending request's token stands for.
#[derive(Debug)]
pub(crate) enum Token {
    /// One put/get segment of an op.
    Rma(u64),
    /// The flush that ends a WRITE op.
    Flush(u64),
    /// A control message being sent on a connection (its buffer must outlive the send).
    Send { conn: u64, _buf: Vec<u8> },
}

/// What requests UCX may still run can touch, after they were abandoned (see `abandon`) or their
/// peer left mid-op (see `drop_inbound`): kept until the thread ends, after the worker (and every
/// request on it) is destroyed. Engine-allocated memory is detached (its region can deregister;
/// the mapping stays); memory registered with `register_raw` keeps its region's deregistration
/// waiting. It grows only when connections end abnormally with requests in flight.
#[derive(Debug, Default)]
pub(crate) struct Graveyard {
    memory: Vec<std::result::Result<DetachedMemory, MemSlice>>,
    handles: Vec<Rc<MemHandle>>,
    /// Destroyed before the worker: UCX allocates unpacked keys from it.
    rkeys: Vec<Rc<RemoteKey>>,
    /// Control messages still queued for sending (their buffers).
    sends: Vec<Token>,
}

impl Graveyard {
    pub(crate) fn bury(
        &mut self,
        memory: MemSlice,
        memh: Option<Rc<MemHandle>>,
        rkey: Option<Rc<RemoteKey>>,
    ) {
        self.memory.push(memory.detach());
        self.handles.extend(memh);
        self.rkeys.extend(rkey);
    }

    /// Destroys the unpacked remote keys (before the worker they were allocated from).
    pub(crate) fn drop_rkeys(&mut self) {
        self.rkeys.clear();
    }

    pub(crate) fn bury_send(&mut self, token: Token) {
        if matches!(token, Token::Send { .. }) {
            self.sends.push(token);
        }
    }
}

/// Pending requests by token.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    next: u64,
    map: HashMap<u64, Token>,
}

impl Tokens {
    pub(crate) fn add(&mut self, t: Token) -> u64 {
        self.next += 1;
        self.map.insert(self.next, t);
        self.next
    }

    /// Whether no request is pending.
    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub(crate) fn forget(&mut self, token: u64) {
        self.map.remove(&token);
    }

    /// Removes and returns the pending requests `pick` selects.
    pub(crate) fn take_if(&mut self, pick: impl Fn(&Token) -> bool) -> Vec<Token> {
        let ids: Vec<u64> = self.map.iter().filter(|(_, t)| pick(t)).map(|(&k, _)| k).collect();
        ids.into_iter().filter_map(|k| self.map.remove(&k)).collect()
    }

    pub(crate) fn take(&mut self, token: u64) -> Option<Token> {
        self.map.remove(&token)
    }

    /// Sends one control message on `ep`, keeping its buffer until the send completes.
    pub(crate) fn send(&mut self, ep: &Endpoint, conn: u64, msg: &Msg<'_>) -> Result<()> {
        let buf = msg.encode();
        let token = self.add(Token::Send { conn, _buf: Vec::new() });
        match ep.send(&buf, token) {
            Ok(Started::Done) => {
                self.forget(token);
                Ok(())
            }
            Ok(Started::Pending) => {
                // The Vec's heap buffer does not move when the Vec does.
                self.map.insert(token, Token::Send { conn, _buf: buf });
                Ok(())
            }
            Err(e) => {
                self.forget(token);
                Err(e)
            }
        }
    }
}
