//! The producer side: which payloads are held, which chunks are ready, who subscribed, and the
//! lease that decides when a buffer is released. Generic over the buffer `B` (the connector holds
//! its registered region; tests hold a counter), so releasing is an [`Action`] that hands it back.

use std::collections::HashMap;
use std::time::Instant;

use tensorwire_core::EngineId;

use crate::control::{Control, Gone};
use crate::error::{ConnectorError, Result};
use crate::lease::{Lease, LeaseState};

/// What the IO layer does for the publisher.
#[derive(Debug, PartialEq, Eq)]
pub enum Action<B> {
    /// Send a control message to a consumer's engine.
    Send {
        /// The consumer.
        to: EngineId,
        /// The message.
        msg: Control,
    },
    /// Every chunk of a store-mode payload is ready: put the buffer's bytes into the store
    /// (the publisher no longer holds it).
    Store {
        /// The payload.
        payload: u64,
        /// Its buffer.
        buffer: B,
    },
    /// Nobody needs the buffer any more (lease ended, retired, abandoned): release it.
    Release {
        /// The payload.
        payload: u64,
        /// Its buffer.
        buffer: B,
    },
}

#[derive(Debug)]
struct Held<B> {
    buffer: B,
    /// Per chunk: `None` not ready, `Some(crc)` ready.
    ready: Vec<Option<Option<u32>>>,
    subscribers: Vec<EngineId>,
    lease: Lease,
    to_store: bool,
}

impl<B> Held<B> {
    fn complete(&self) -> bool {
        self.ready.iter().all(Option::is_some)
    }
}

/// Ended payloads remembered, so a late consumer learns why its payload is gone.
const REMEMBERED: usize = 4096;

/// The payloads a connector holds.
#[derive(Debug)]
pub struct Publisher<B> {
    held: HashMap<u64, Held<B>>,
    /// The last [`REMEMBERED`] payloads that ended, and why.
    ended: std::collections::VecDeque<(u64, Gone)>,
}

impl<B> Default for Publisher<B> {
    fn default() -> Self {
        Publisher { held: HashMap::new(), ended: Default::default() }
    }
}

fn gone<B>(to: &[EngineId], payload: u64, why: Gone, out: &mut Vec<Action<B>>) {
    for &to in to {
        out.push(Action::Send { to, msg: Control::Gone { payload, why } });
    }
}

impl<B> Publisher<B> {
    /// Payloads held (p2p buffers waiting for consumers, store payloads waiting for chunks).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Holds `buffer` as payload `id` of `chunks` chunks, none ready yet. `to_store`: once every
    /// chunk is ready it goes to the store (else consumers read it here until its lease ends).
    pub fn publish(&mut self, id: u64, buffer: B, chunks: u32, lease: Lease, to_store: bool) {
        let ready = vec![None; chunks as usize];
        let h = Held { buffer, ready, subscribers: Vec::new(), lease, to_store };
        self.held.insert(id, h);
    }

    /// The buffer of `id`, while held.
    pub fn buffer(&self, id: u64) -> Option<&B> {
        self.held.get(&id).map(|h| &h.buffer)
    }

    /// Whether chunk `index` of `id` was marked ready (`None`: not held, or no such chunk).
    pub fn is_ready(&self, id: u64, index: u32) -> Option<bool> {
        self.held.get(&id)?.ready.get(index as usize).map(Option::is_some)
    }

    /// Chunk `index` of `id` is written (`crc`: its checksum, with checksums on); announces it
    /// to the subscribers. Returns whether the payload is now complete.
    pub fn mark_ready(
        &mut self,
        id: u64,
        index: u32,
        crc: Option<u32>,
        out: &mut Vec<Action<B>>,
    ) -> Result<bool> {
        let h = self.held.get_mut(&id).ok_or_else(|| ConnectorError::Missing {
            payload: id.to_string(),
            why: "this connector no longer holds it".into(),
        })?;
        let n = h.ready.len();
        let slot = h.ready.get_mut(index as usize).ok_or_else(|| {
            ConnectorError::InvalidArgument(format!("chunk {index} of a payload of {n} chunks"))
        })?;
        if slot.is_some() {
            return Err(ConnectorError::InvalidArgument(format!(
                "chunk {index} marked ready twice"
            )));
        }
        *slot = Some(crc);
        for &to in &h.subscribers {
            out.push(Action::Send { to, msg: Control::Ready { payload: id, index, crc } });
        }
        let complete = h.complete();
        if complete && h.to_store {
            if let Some(h) = self.held.remove(&id) {
                out.push(Action::Store { payload: id, buffer: h.buffer });
            }
        }
        Ok(complete)
    }

    /// Removes `id` and releases its buffer, telling its subscribers `why`.
    fn drop_payload(&mut self, id: u64, why: Gone, out: &mut Vec<Action<B>>) {
        if let Some(h) = self.held.remove(&id) {
            gone(&h.subscribers, id, why, out);
            out.push(Action::Release { payload: id, buffer: h.buffer });
            if self.ended.len() == REMEMBERED {
                self.ended.pop_front();
            }
            self.ended.push_back((id, why));
        }
    }

    /// A consumer asks for `id`: it is told every chunk already ready, and later ones as they
    /// are marked; or why it cannot have it.
    pub fn subscribe(&mut self, from: EngineId, id: u64, now: Instant, out: &mut Vec<Action<B>>) {
        let Some(h) = self.held.get_mut(&id).filter(|h| !h.to_store) else {
            let why = self.ended.iter().find(|(e, _)| *e == id).map_or(Gone::NotPublished, |e| e.1);
            return gone(&[from], id, why, out);
        };
        let end = match h.lease.state(now) {
            LeaseState::Live => None,
            LeaseState::Consumed => Some(Gone::Consumed),
            LeaseState::Expired => Some(Gone::Expired),
        };
        if let Some(why) = end {
            gone(&[from], id, why, out);
            return self.drop_payload(id, why, out);
        }
        if !h.subscribers.contains(&from) {
            h.subscribers.push(from);
        }
        for (k, r) in h.ready.iter().enumerate() {
            if let Some(crc) = *r {
                out.push(Action::Send {
                    to: from,
                    msg: Control::Ready { payload: id, index: k as u32, crc },
                });
            }
        }
    }

    /// A consumer is done with `id`; the buffer goes once the lease says so.
    pub fn consumed(&mut self, from: EngineId, id: u64, now: Instant, out: &mut Vec<Action<B>>) {
        let Some(h) = self.held.get_mut(&id) else { return };
        if !h.subscribers.contains(&from) {
            return; // only a consumer that subscribed counts
        }
        h.subscribers.retain(|&s| s != from);
        if h.lease.consume(now) != LeaseState::Live {
            self.drop_payload(id, Gone::Consumed, out);
        }
    }

    /// The producer drops `id` now, its lease notwithstanding.
    pub fn retire(&mut self, id: u64, out: &mut Vec<Action<B>>) {
        self.drop_payload(id, Gone::Retired, out);
    }

    /// The producer's publication of `id` ended: a payload not yet complete is abandoned (its
    /// subscribers are told instead of left waiting); a complete one stays for its lease.
    pub fn abandon(&mut self, id: u64, out: &mut Vec<Action<B>>) {
        if self.held.get(&id).is_some_and(|h| !h.complete()) {
            self.drop_payload(id, Gone::Abandoned, out);
        }
    }

    /// Releases p2p payloads whose lease expired by `now`.
    pub fn sweep(&mut self, now: Instant, out: &mut Vec<Action<B>>) {
        let dead: Vec<u64> = self
            .held
            .iter_mut()
            .filter_map(|(&id, h)| {
                (!h.to_store && h.lease.state(now) != LeaseState::Live).then_some(id)
            })
            .collect();
        for id in dead {
            self.drop_payload(id, Gone::Expired, out);
        }
    }
}
