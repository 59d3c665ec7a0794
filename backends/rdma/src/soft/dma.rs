//! The software NIC's queue pairs and the DMA threads that run their work requests: in order per
//! QP, one QP on one thread at a time, QPs round robin.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};

use super::{MrInner, NicShared, SoftCq, find, lock};
use crate::verbs::{
    Qp, QpAddress, QpCaps, QpState, QpTiming, Sge, VResult, VerbsError, Wc, WcStatus, Wr, WrOp,
};

/// QPs with queued requests, and the DMA threads' wake-up. Shared by the NIC and its threads (a
/// thread holds no NIC while idle, so an unused NIC is dropped and its threads stop).
#[derive(Debug, Default)]
pub(crate) struct Sched {
    ready: Mutex<Ready>,
    wake: Condvar,
    /// How long an idle DMA thread spins before it sleeps.
    pub(crate) spin: std::time::Duration,
}

#[derive(Debug, Default)]
struct Ready {
    qps: VecDeque<Arc<QpShared>>,
    stop: bool,
}

impl Sched {
    /// A scheduler whose idle threads spin `spin` before sleeping.
    pub(crate) fn new(spin: std::time::Duration) -> Sched {
        Sched { spin, ..Sched::default() }
    }

    fn push(&self, qp: Arc<QpShared>) {
        lock(&self.ready).qps.push_back(qp);
        self.wake.notify_one();
    }

    /// Stops the DMA threads (the NIC is gone).
    pub(crate) fn stop(&self) {
        lock(&self.ready).stop = true;
        self.wake.notify_all();
    }

    fn next(&self) -> Option<Arc<QpShared>> {
        if !self.spin.is_zero() {
            // A NIC polls its queues without a wake-up; spinning a while before sleeping keeps
            // a thread wake-up (tens of microseconds on a VM) out of each request's latency.
            let t = std::time::Instant::now();
            while t.elapsed() < self.spin {
                if let Some(qp) = lock(&self.ready).qps.pop_front() {
                    return Some(qp);
                }
                std::hint::spin_loop();
            }
        }
        let mut r = lock(&self.ready);
        loop {
            if r.stop {
                return None;
            }
            if let Some(qp) = r.qps.pop_front() {
                return Some(qp);
            }
            r = self.wake.wait(r).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// A DMA thread: runs one request of the next ready QP, then requeues the QP if it has more.
pub(crate) fn run(sched: Arc<Sched>) {
    while let Some(qp) = sched.next() {
        if qp.step() {
            sched.push(qp);
        }
    }
}

/// A request as the send queue keeps it.
#[derive(Debug)]
struct Queued {
    id: u64,
    op: WrOp,
    sges: Vec<Sge>,
    remote_addr: u64,
    rkey: u32,
}

#[derive(Debug)]
struct QpData {
    state: QpState,
    /// The peer QP: (GID of its NIC, its number).
    dest: Option<([u8; 16], u32)>,
    sq: VecDeque<Queued>,
    /// In the NIC's ready queue (or running).
    scheduled: bool,
}

/// A QP's state, shared by its handle and the DMA threads.
#[derive(Debug)]
pub(crate) struct QpShared {
    qpn: u32,
    nic: Arc<NicShared>,
    cq: Arc<SoftCq>,
    caps: QpCaps,
    data: Mutex<QpData>,
}

impl QpShared {
    /// Moves the QP to ERROR; queued requests are flushed by the DMA threads.
    pub(crate) fn to_error(self: &Arc<Self>) {
        let mut d = lock(&self.data);
        d.state = QpState::Error;
        self.schedule(&mut d);
    }

    fn schedule(self: &Arc<Self>, d: &mut QpData) {
        if !d.scheduled && !d.sq.is_empty() {
            d.scheduled = true;
            self.nic.sched.push(self.clone());
        }
    }

    /// Runs the next queued request; whether more are queued.
    fn step(self: &Arc<Self>) -> bool {
        let (wr, state, dest) = {
            let mut d = lock(&self.data);
            match d.sq.pop_front() {
                Some(wr) => (wr, d.state, d.dest),
                None => {
                    d.scheduled = false;
                    return false;
                }
            }
        };
        let status = match (state, dest) {
            (QpState::Rts, Some(dest)) => self.execute(&wr, dest),
            _ => WcStatus::Flushed,
        };
        let c = &self.nic.counters;
        c.wrs.fetch_add(1, Ordering::Relaxed);
        if !matches!(status, WcStatus::Success | WcStatus::Flushed) {
            c.errors.fetch_add(1, Ordering::Relaxed);
            lock(&self.data).state = QpState::Error;
        }
        let delay = lock(&self.nic.faults).delay;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        self.cq.push(Wc { id: wr.id, status });
        let mut d = lock(&self.data);
        if d.sq.is_empty() {
            d.scheduled = false;
            false
        } else {
            true
        }
    }

    /// What a requester and a responder NIC check, in their order, then the copy.
    fn execute(&self, wr: &Queued, dest: ([u8; 16], u32)) -> WcStatus {
        if let Some(s) = lock(&self.nic.faults).fail.pop_front() {
            return s;
        }
        let unreachable = || {
            // The requester retries until its transport timeout, then gives up.
            std::thread::sleep(self.nic.retry_delay);
            WcStatus::RetryExceeded
        };
        let Some(remote) = find(&self.nic.fabric, &dest.0) else { return unreachable() };
        let rqp = lock(&remote.qps).get(&dest.1).and_then(Weak::upgrade);
        let Some(rqp) = rqp else { return unreachable() };
        let connected = {
            let d = lock(&rqp.data);
            matches!(d.state, QpState::Rtr | QpState::Rts)
                && d.dest == Some((self.nic.info.address.gid, self.qpn))
        };
        if !connected {
            return unreachable();
        }
        let len: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
        let Some(rmr) = remote.mr(wr.rkey) else { return WcStatus::RemoteAccess };
        let granted = match wr.op {
            WrOp::Write => rmr.access.remote_write,
            WrOp::Read => rmr.access.remote_read,
        };
        if !granted || !inside(&rmr, wr.remote_addr, len) {
            return WcStatus::RemoteAccess;
        }
        // Local entries: each inside an MR of this NIC, writable for a READ.
        let mut mrs: Vec<Arc<MrInner>> = vec![rmr];
        for s in &wr.sges {
            let Some(m) = self.nic.mr(s.lkey) else { return WcStatus::LocalProtection };
            if !inside(&m, s.addr, u64::from(s.len)) {
                return WcStatus::LocalLength;
            }
            if wr.op == WrOp::Read && !m.access.local_write {
                return WcStatus::LocalProtection;
            }
            if !mrs.iter().any(|x| Arc::ptr_eq(x, &m)) {
                mrs.push(m);
            }
        }
        // Hold every MR involved (once each): a deregistration waits for this copy.
        let _held: Vec<_> = mrs
            .iter()
            .map(|m| m.inuse.read().unwrap_or_else(std::sync::PoisonError::into_inner))
            .collect();
        let mut at = wr.remote_addr as usize;
        for s in &wr.sges {
            let n = s.len as usize;
            let (src, dst) = match wr.op {
                WrOp::Write => (s.addr as usize, at),
                WrOp::Read => (at, s.addr as usize),
            };
            // SAFETY: both ranges were checked to lie inside live MRs of memory whose
            // registration promised it valid while the MR exists; the MRs are held (their
            // deregistration waits for `_held`). `copy_bytes` tolerates overlap (a region
            // written from itself), and avoids the C library's slow distances.
            unsafe { tensorwire_core::backend::kit::copy_bytes(src, dst, n) };
            at += n;
        }
        self.nic.counters.bytes.fetch_add(len, Ordering::Relaxed);
        WcStatus::Success
    }
}

fn inside(mr: &MrInner, addr: u64, len: u64) -> bool {
    let base = mr.addr as u64;
    addr >= base && addr.checked_add(len).is_some_and(|end| end <= base + mr.len)
}

/// A QP's handle. Dropping it destroys the QP: it leaves the NIC's table and queued requests
/// are flushed.
#[derive(Debug)]
pub(crate) struct SoftQp {
    shared: Arc<QpShared>,
}

impl SoftQp {
    pub(crate) fn new(nic: &Arc<NicShared>, cq: Arc<SoftCq>, caps: QpCaps) -> SoftQp {
        let qpn = nic.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let shared = Arc::new(QpShared {
            qpn,
            nic: nic.clone(),
            cq,
            caps,
            data: Mutex::new(QpData {
                state: QpState::Reset,
                dest: None,
                sq: VecDeque::new(),
                scheduled: false,
            }),
        });
        lock(&nic.qps).insert(qpn, Arc::downgrade(&shared));
        SoftQp { shared }
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        lock(&self.shared.nic.qps).remove(&self.shared.qpn);
        self.shared.to_error();
    }
}

fn refused(call: &'static str, state: QpState, want: &str) -> VerbsError {
    VerbsError::new(call, format!("QP in {state:?}, needs {want} (EINVAL)"))
}

impl Qp for SoftQp {
    fn qpn(&self) -> u32 {
        self.shared.qpn
    }

    fn state(&self) -> QpState {
        lock(&self.shared.data).state
    }

    fn init(&self) -> VResult<()> {
        self.shared.nic.ensure_present("ibv_modify_qp")?;
        let mut d = lock(&self.shared.data);
        if d.state != QpState::Reset {
            return Err(refused("ibv_modify_qp(INIT)", d.state, "RESET"));
        }
        d.state = QpState::Init;
        Ok(())
    }

    fn connect(&self, _psn: u32, remote: &QpAddress, _timing: &QpTiming) -> VResult<()> {
        self.shared.nic.ensure_present("ibv_modify_qp")?;
        let mut d = lock(&self.shared.data);
        if d.state != QpState::Init {
            return Err(refused("ibv_modify_qp(RTR)", d.state, "INIT"));
        }
        d.dest = Some((remote.gid, remote.qpn));
        d.state = QpState::Rts;
        Ok(())
    }

    fn to_error(&self) -> VResult<()> {
        self.shared.to_error();
        Ok(())
    }

    fn post(&self, wrs: &[Wr<'_>]) -> std::result::Result<(), (usize, VerbsError)> {
        let s = &self.shared;
        let mut d = lock(&s.data);
        if !matches!(d.state, QpState::Rts | QpState::Error) {
            return Err((0, refused("ibv_post_send", d.state, "RTS")));
        }
        for (i, wr) in wrs.iter().enumerate() {
            if d.sq.len() >= s.caps.max_send_wr as usize {
                return Err((i, VerbsError::new("ibv_post_send", "send queue full (ENOMEM)")));
            }
            if wr.sges.len() > s.caps.max_sge as usize {
                return Err((i, VerbsError::new("ibv_post_send", "too many SGEs (EINVAL)")));
            }
            d.sq.push_back(Queued {
                id: wr.id,
                op: wr.op,
                sges: wr.sges.to_vec(),
                remote_addr: wr.remote_addr,
                rkey: wr.rkey,
            });
        }
        s.schedule(&mut d);
        Ok(())
    }
}
