//! The producer side: which payloads are held, which chunks are ready, who subscribed, the lease
//! that decides when a payload stops being served, and the subscribers' holds that decide when
//! its buffer may go. Generic over the buffer `B` (the connector holds its registered region;
//! tests hold a counter), so releasing is an [`Action`] that hands it back.
//!
//! A consumer may read a payload before its subscription arrives (the read and the subscription
//! travel at once). That is sound because a payload, once no longer held, is never held again:
//! a payload still served when the subscription arrives was served during every earlier read,
//! and the subscription's hold keeps the buffer for the reads after, even past the lease's end,
//! until the consumer says `Done` or its hold runs out.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tensorwire_core::EngineId;

use crate::control::{Control, Gone, MAX_HOLD};
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
    /// Who subscribed, each with the end of its hold.
    subscribers: Vec<(EngineId, Instant)>,
    lease: Lease,
    to_store: bool,
    /// Published whole: its subscribers learn it is ready from the subscription's acceptance.
    whole: bool,
    /// Why it is no longer served; the buffer stays until every hold has ended.
    ended: Option<Gone>,
}

impl<B> Held<B> {
    fn complete(&self) -> bool {
        self.ready.iter().all(Option::is_some)
    }

    fn live(&self) -> bool {
        self.ended.is_none()
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

fn gone<B>(
    to: impl IntoIterator<Item = EngineId>,
    payload: u64,
    why: Gone,
    out: &mut Vec<Action<B>>,
) {
    for to in to {
        out.push(Action::Send { to, msg: Control::Gone { payload, why } });
    }
}

impl<B> Publisher<B> {
    /// Payloads held: p2p buffers waiting for consumers (or for the holds of the ones still
    /// reading), store payloads waiting for chunks.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Subscriptions to held payloads (consumers reading, or holding a buffer past its lease).
    pub fn readers(&self) -> usize {
        self.held.values().map(|h| h.subscribers.len()).sum()
    }

    /// Holds `buffer` as payload `id` of `chunks` chunks, none ready yet. `to_store`: once every
    /// chunk is ready it goes to the store (else consumers read it here until its lease ends).
    pub fn publish(&mut self, id: u64, buffer: B, chunks: u32, lease: Lease, to_store: bool) {
        self.insert(id, buffer, vec![None; chunks as usize], lease, to_store, false);
    }

    /// Holds `buffer` as p2p payload `id`, one chunk, ready now (`crc`: its checksum, with
    /// checksums on, which its consumers find in its reference). A subscription to it is its
    /// announcement: the consumer learns it is subscribed from [`Publisher::subscribe`]'s
    /// verdict (the connector's notification handler answers with it), so no `Ready` is sent.
    pub fn publish_whole(&mut self, id: u64, buffer: B, crc: Option<u32>, lease: Lease) {
        self.insert(id, buffer, vec![Some(crc)], lease, false, true);
    }

    fn insert(
        &mut self,
        id: u64,
        buffer: B,
        ready: Vec<Option<Option<u32>>>,
        lease: Lease,
        to_store: bool,
        whole: bool,
    ) {
        let subscribers = Vec::new();
        let h = Held { buffer, ready, subscribers, lease, to_store, whole, ended: None };
        self.held.insert(id, h);
    }

    fn live(&self, id: u64) -> Option<&Held<B>> {
        self.held.get(&id).filter(|h| h.live())
    }

    /// The buffer of `id`, while it is served.
    pub fn buffer(&self, id: u64) -> Option<&B> {
        self.live(id).map(|h| &h.buffer)
    }

    /// Whether chunk `index` of `id` was marked ready (`None`: not served, or no such chunk).
    pub fn is_ready(&self, id: u64, index: u32) -> Option<bool> {
        self.live(id)?.ready.get(index as usize).map(Option::is_some)
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
        let h =
            self.held.get_mut(&id).filter(|h| h.live()).ok_or_else(|| ConnectorError::Missing {
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
        for &(to, _) in &h.subscribers {
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

    /// `id` is no longer served, for `why`. Subscribers of an incomplete payload are told (they
    /// wait for chunks that will not come); the buffer goes once no subscriber holds it.
    fn end(&mut self, id: u64, why: Gone, out: &mut Vec<Action<B>>) {
        let Some(h) = self.held.get_mut(&id).filter(|h| h.live()) else { return };
        h.ended = Some(why);
        if !h.complete() {
            gone(h.subscribers.iter().map(|s| s.0), id, why, out);
        }
        if self.ended.len() == REMEMBERED {
            self.ended.pop_front();
        }
        self.ended.push_back((id, why));
        self.release_if_free(id, out);
    }

    /// Releases `id`'s buffer if it ended and nobody holds it.
    fn release_if_free(&mut self, id: u64, out: &mut Vec<Action<B>>) {
        if self.held.get(&id).is_some_and(|h| !h.live() && h.subscribers.is_empty()) {
            if let Some(h) = self.held.remove(&id) {
                out.push(Action::Release { payload: id, buffer: h.buffer });
            }
        }
    }

    /// A consumer asks for `id` and holds it for `hold` (at most [`MAX_HOLD`]) from `now`: it is
    /// told every chunk already ready, and later ones as they are marked; or why it cannot have
    /// it. Returns whether it is subscribed.
    pub fn subscribe(
        &mut self,
        from: EngineId,
        id: u64,
        hold: Duration,
        now: Instant,
        out: &mut Vec<Action<B>>,
    ) -> bool {
        if !self.served(from, id, now, out) {
            return false;
        }
        let Some(h) = self.held.get_mut(&id) else { return false };
        let until = now.checked_add(hold.min(MAX_HOLD)).unwrap_or(now);
        match h.subscribers.iter_mut().find(|s| s.0 == from) {
            Some(s) => s.1 = s.1.max(until),
            None => h.subscribers.push((from, until)),
        }
        if h.whole {
            return true;
        }
        for (k, r) in h.ready.iter().enumerate() {
            if let Some(crc) = *r {
                out.push(Action::Send {
                    to: from,
                    msg: Control::Ready { payload: id, index: k as u32, crc },
                });
            }
        }
        true
    }

    /// Whether p2p payload `id` is served at `now`. If not, `from` is told why, and a payload
    /// whose lease just ended ends.
    fn served(&mut self, from: EngineId, id: u64, now: Instant, out: &mut Vec<Action<B>>) -> bool {
        let why = match self.held.get_mut(&id).filter(|h| !h.to_store) {
            None => self.ended.iter().find(|(e, _)| *e == id).map_or(Gone::NotPublished, |e| e.1),
            Some(h) => match (h.ended, h.lease.state(now)) {
                (None, LeaseState::Live) => return true,
                (Some(why), _) => why,
                (None, LeaseState::Consumed) => Gone::Consumed,
                (None, LeaseState::Expired) => Gone::Expired,
            },
        };
        gone([from], id, why, out);
        self.end(id, why, out);
        false
    }

    /// Removes `from`'s subscription to `id`; whether it was there.
    fn leave(&mut self, from: EngineId, id: u64) -> bool {
        let Some(h) = self.held.get_mut(&id) else { return false };
        let before = h.subscribers.len();
        h.subscribers.retain(|s| s.0 != from);
        h.subscribers.len() != before
    }

    /// A consumer is done reading `id` (`consumed`: it counts as a consumer of the lease): its
    /// hold ends. Returns whether `id` was still served; if not, it is told why.
    pub fn done(
        &mut self,
        from: EngineId,
        id: u64,
        consumed: bool,
        now: Instant,
        out: &mut Vec<Action<B>>,
    ) -> bool {
        let left = self.leave(from, id);
        if !self.served(from, id, now, out) {
            if left {
                self.release_if_free(id, out);
            }
            return false;
        }
        let Some(h) = self.held.get_mut(&id) else { return false };
        if consumed && h.lease.consume(now) != LeaseState::Live {
            self.end(id, Gone::Consumed, out);
        } else if left {
            self.release_if_free(id, out);
        }
        true
    }

    /// The producer stops serving `id` now, its lease notwithstanding (readers holding it finish).
    pub fn retire(&mut self, id: u64, out: &mut Vec<Action<B>>) {
        self.end(id, Gone::Retired, out);
    }

    /// The producer's publication of `id` ended: a payload not yet complete is abandoned (its
    /// subscribers are told instead of left waiting); a complete one stays for its lease.
    pub fn abandon(&mut self, id: u64, out: &mut Vec<Action<B>>) {
        if self.live(id).is_some_and(|h| !h.complete()) {
            self.end(id, Gone::Abandoned, out);
        }
    }

    /// At `now`: ends p2p payloads whose lease expired, and releases ended payloads whose
    /// holds ran out.
    pub fn sweep(&mut self, now: Instant, out: &mut Vec<Action<B>>) {
        let mut expired: Vec<u64> = self
            .held
            .iter_mut()
            .filter_map(|(&id, h)| {
                (h.live() && !h.to_store && h.lease.state(now) != LeaseState::Live).then_some(id)
            })
            .collect();
        expired.sort_unstable();
        for id in expired {
            self.end(id, Gone::Expired, out);
        }
        let mut free: Vec<u64> = self
            .held
            .iter_mut()
            .filter_map(|(&id, h)| {
                (!h.live()).then(|| h.subscribers.retain(|s| s.1 > now))?;
                h.subscribers.is_empty().then_some(id)
            })
            .collect();
        free.sort_unstable();
        for id in free {
            self.release_if_free(id, out);
        }
    }
}
