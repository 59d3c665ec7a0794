//! A fake NCCL over host memory, for tests on machines without GPUs: two ranks of one process
//! join by unique id (each blocks until the other arrives, as `ncclCommInitRank` does); each
//! rank runs its posted ops in order on its own thread; a send's bytes are copied out and queued
//! for the other rank, whose receives take them in order and must name the same length.
//! `abort` ends both ranks' pending and later ops with an error.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};
use tensorwire_core::backend::kit::lock;

use tensorwire_core::{Error, MemoryKinds, Result};

use crate::NAME;
use crate::comm::{Comm, Done, Nccl, UniqueId};

/// Communicators waiting for their second rank, by unique id.
static WAITING: LazyLock<Mutex<HashMap<UniqueId, Arc<Wire>>>> = LazyLock::new(Default::default);
static JOINED: Condvar = Condvar::new();

/// The two directions between the ranks, and whether the communicator was aborted.
#[derive(Debug, Default)]
struct Wire {
    /// Messages to rank i (sent by the other).
    inbox: [Mutex<VecDeque<Vec<u8>>>; 2],
    arrived: Condvar,
    aborted: AtomicBool,
    joined: Mutex<u32>,
}

fn aborted() -> Error {
    Error::PeerClosed("fake-nccl: communicator aborted".into())
}

/// A host-memory NCCL (see the module docs).
#[derive(Debug, Default)]
pub struct FakeNccl;

impl FakeNccl {
    /// A fake NCCL.
    pub fn new() -> Arc<FakeNccl> {
        Arc::new(FakeNccl)
    }
}

impl Nccl for FakeNccl {
    fn name(&self) -> &'static str {
        "fake-nccl"
    }

    fn memory(&self) -> MemoryKinds {
        MemoryKinds::HOST
    }

    fn unique_id(&self) -> Result<UniqueId> {
        let mut id = [0u8; 128];
        for b in id.iter_mut() {
            *b = rand::random();
        }
        Ok(id)
    }

    fn join(
        &self,
        id: &UniqueId,
        rank: u32,
        _ordinal: u32,
        timeout: Duration,
    ) -> Result<Arc<dyn Comm>> {
        if rank > 1 {
            return Err(Error::InvalidArgument(format!("{NAME}: rank {rank} of 2")));
        }
        let deadline = Instant::now() + timeout;
        let mut waiting = lock(&WAITING);
        let wire = waiting.entry(*id).or_default().clone();
        *lock(&wire.joined) += 1;
        JOINED.notify_all();
        while *lock(&wire.joined) < 2 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                waiting.remove(id);
                return Err(Error::timeout(
                    format!("{NAME}: the other rank never joined"),
                    timeout,
                ));
            }
            waiting = JOINED.wait_timeout(waiting, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        waiting.remove(id);
        drop(waiting);
        Ok(Arc::new(FakeComm::start(wire, rank as usize)))
    }
}

/// An op posted on one rank.
enum Posted {
    Send { addr: u64, len: u64, done: Done },
    Recv { addr: u64, len: u64, done: Done },
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Posted>,
    closed: bool,
}

/// One rank: its posted ops, run in order by its thread.
struct FakeComm {
    wire: Arc<Wire>,
    queue: Arc<(Mutex<Queue>, Condvar)>,
}

impl std::fmt::Debug for FakeComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeComm").finish_non_exhaustive()
    }
}

impl FakeComm {
    fn start(wire: Arc<Wire>, rank: usize) -> FakeComm {
        let queue: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let (w, q) = (wire.clone(), queue.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("tw-fake-nccl-{rank}"))
            .spawn(move || run(w, q, rank));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "fake-nccl: cannot start a rank's thread");
            wire.aborted.store(true, Ordering::Release);
        }
        FakeComm { wire, queue }
    }

    fn post(&self, op: Posted) {
        let (m, cv) = &*self.queue;
        let mut q = lock(m);
        if q.closed || self.wire.aborted.load(Ordering::Acquire) {
            drop(q);
            fail(op);
            return;
        }
        q.ops.push_back(op);
        cv.notify_one();
    }
}

fn fail(op: Posted) {
    match op {
        Posted::Send { done, .. } | Posted::Recv { done, .. } => done(Err(aborted())),
    }
}

/// A rank's thread: runs posted ops in order until the rank is dropped.
fn run(wire: Arc<Wire>, queue: Arc<(Mutex<Queue>, Condvar)>, rank: usize) {
    let (m, cv) = &*queue;
    loop {
        let op = {
            let mut q = lock(m);
            loop {
                if let Some(op) = q.ops.pop_front() {
                    break op;
                }
                if q.closed {
                    return;
                }
                q = cv
                    .wait_timeout(q, Duration::from_millis(100))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        };
        if wire.aborted.load(Ordering::Acquire) {
            fail(op);
            continue;
        }
        match op {
            Posted::Send { addr, len, done } => {
                let mut bytes = vec![0u8; len as usize];
                // SAFETY: the poster keeps `[addr, addr + len)` readable until `done` (the
                // seam's contract); a distinct Vec, so no overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        addr as *const u8,
                        bytes.as_mut_ptr(),
                        bytes.len(),
                    )
                };
                lock(&wire.inbox[1 - rank]).push_back(bytes);
                wire.arrived.notify_all();
                done(Ok(()));
            }
            Posted::Recv { addr, len, done } => {
                let got = {
                    let mut inbox = lock(&wire.inbox[rank]);
                    loop {
                        if let Some(b) = inbox.pop_front() {
                            break Some(b);
                        }
                        if wire.aborted.load(Ordering::Acquire) || lock(m).closed {
                            break None;
                        }
                        inbox = wire
                            .arrived
                            .wait_timeout(inbox, Duration::from_millis(50))
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                };
                match got {
                    Some(b) if b.len() as u64 == len => {
                        // SAFETY: the poster keeps `[addr, addr + len)` writable until `done`.
                        unsafe {
                            std::ptr::copy_nonoverlapping(b.as_ptr(), addr as *mut u8, b.len())
                        };
                        done(Ok(()));
                    }
                    Some(b) => {
                        // A length mismatch is a protocol bug NCCL would not survive either.
                        wire.aborted.store(true, Ordering::Release);
                        wire.arrived.notify_all();
                        done(Err(Error::Internal(format!(
                            "fake-nccl: a receive of {len} bytes matched a send of {}",
                            b.len()
                        ))));
                    }
                    None => done(Err(aborted())),
                }
            }
        }
    }
}

impl Drop for FakeComm {
    fn drop(&mut self) {
        let (m, cv) = &*self.queue;
        let pending: Vec<Posted> = {
            let mut q = lock(m);
            q.closed = true;
            q.ops.drain(..).collect()
        };
        cv.notify_all();
        self.wire.arrived.notify_all();
        pending.into_iter().for_each(fail);
    }
}

impl Comm for FakeComm {
    unsafe fn send(&self, addr: u64, len: u64, done: Done) {
        self.post(Posted::Send { addr, len, done });
    }

    unsafe fn recv(&self, addr: u64, len: u64, done: Done) {
        self.post(Posted::Recv { addr, len, done });
    }

    fn abort(&self) {
        self.wire.aborted.store(true, Ordering::Release);
        self.wire.arrived.notify_all();
        let (m, cv) = &*self.queue;
        let pending: Vec<Posted> = lock(m).ops.drain(..).collect();
        cv.notify_all();
        pending.into_iter().for_each(fail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::sync_channel;

    fn pair() -> (Arc<dyn Comm>, Arc<dyn Comm>) {
        let n = FakeNccl::new();
        let id = n.unique_id().unwrap();
        let n2 = n.clone();
        let t = std::thread::spawn(move || n2.join(&id, 1, 0, Duration::from_secs(10)).unwrap());
        let a = n.join(&id, 0, 0, Duration::from_secs(10)).unwrap();
        (a, t.join().unwrap())
    }

    fn done() -> (Done, std::sync::mpsc::Receiver<Result<()>>) {
        let (tx, rx) = sync_channel(1);
        (Box::new(move |r| drop(tx.send(r))), rx)
    }

    #[test]
    fn ranks_join_and_sends_match_receives_in_order() {
        let (a, b) = pair();
        let (one, two) = (vec![1u8; 100], vec![2u8; 50]);
        let (mut r1, mut r2) = (vec![0u8; 100], vec![0u8; 50]);
        let (d1, w1) = done();
        let (d2, w2) = done();
        let (d3, w3) = done();
        let (d4, w4) = done();
        // SAFETY: every buffer outlives its op (each `done` is awaited below).
        unsafe {
            b.recv(r1.as_mut_ptr() as u64, 100, d3);
            b.recv(r2.as_mut_ptr() as u64, 50, d4);
            a.send(one.as_ptr() as u64, 100, d1);
            a.send(two.as_ptr() as u64, 50, d2);
        }
        for w in [w1, w2, w3, w4] {
            w.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        }
        assert_eq!((r1, r2), (one, two));
    }

    #[test]
    fn a_length_mismatch_and_an_abort_end_ops_with_errors() {
        let (a, b) = pair();
        let src = [0u8; 8];
        let mut dst = vec![0u8; 16];
        let (d1, w1) = done();
        let (d2, w2) = done();
        // SAFETY: buffers outlive their ops (awaited below).
        unsafe {
            a.send(src.as_ptr() as u64, 8, d1);
            b.recv(dst.as_mut_ptr() as u64, 16, d2);
        }
        w1.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        let e = w2.recv_timeout(Duration::from_secs(10)).unwrap().unwrap_err();
        assert!(e.to_string().contains("matched a send of 8"), "{e}");
        let (d3, w3) = done();
        // SAFETY: as above; the communicator is aborted, so nothing touches `dst`.
        unsafe { b.recv(dst.as_mut_ptr() as u64, 16, d3) };
        assert!(w3.recv_timeout(Duration::from_secs(10)).unwrap().is_err());
        a.abort();
    }

    #[test]
    fn a_rank_alone_times_out() {
        let n = FakeNccl::new();
        let id = n.unique_id().unwrap();
        let e = n.join(&id, 0, 0, Duration::from_millis(50)).unwrap_err();
        assert!(e.is_peer_failure(), "{e}");
    }
}
