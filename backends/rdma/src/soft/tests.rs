//! The software NIC on its own: RC semantics, the responder's checks, deregistration, faults.

use std::time::{Duration, Instant};

use super::*;
use crate::verbs::{QpAddress, QpState, QpTiming, Sge, Wr, WrOp};

const RW: MrAccess = MrAccess { local_write: true, remote_read: true, remote_write: true };

struct Side {
    nic: Arc<SoftNic>,
    cq: Arc<dyn Cq>,
    qp: Arc<dyn Qp>,
    buf: Vec<u8>,
    mr: Box<dyn Mr>,
}

fn side(fabric: &SoftFabric, len: usize, access: MrAccess) -> Side {
    let nic = fabric.nic(SoftNicSpec::default());
    let cq = nic.create_cq(256).unwrap();
    let qp = nic.create_qp(&cq, QpCaps { max_send_wr: 64, max_sge: 4 }).unwrap();
    qp.init().unwrap();
    let mut buf = vec![0u8; len];
    // SAFETY: `buf`'s heap memory stays put while the `Side` owns it, and `Side`'s drop
    // deregisters the MR before the buffer is freed.
    let mr = unsafe { nic.reg_mr(buf.as_mut_ptr() as usize, len as u64, access, None) }.unwrap();
    Side { nic, cq, qp, buf, mr }
}

impl Drop for Side {
    fn drop(&mut self) {
        // The MR goes before the buffer it covers.
        let mr = std::mem::replace(&mut self.mr, Box::new(NoMr));
        drop(mr);
    }
}

#[derive(Debug)]
struct NoMr;
impl Mr for NoMr {
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
    fn base(&self) -> u64 {
        0
    }
}

fn addr(s: &Side) -> QpAddress {
    s.nic.info().address.qp(s.qp.qpn(), 0)
}

fn pair(len: usize, remote: MrAccess) -> (Side, Side) {
    let fabric = SoftFabric::new();
    let (a, b) = (side(&fabric, len, RW), side(&fabric, len, remote));
    a.qp.connect(0, &addr(&b), &QpTiming::default()).unwrap();
    b.qp.connect(0, &addr(&a), &QpTiming::default()).unwrap();
    (a, b)
}

fn wait(cq: &Arc<dyn Cq>, n: usize) -> Vec<Wc> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n {
        let want = n - out.len();
        cq.poll(&mut out, want).unwrap();
        assert!(Instant::now() < deadline, "{} of {n} completions", out.len());
        std::thread::sleep(Duration::from_micros(50));
    }
    out
}

fn sge(s: &Side, off: usize, len: u32) -> Sge {
    Sge { addr: s.mr.base() + off as u64, len, lkey: s.mr.lkey() }
}

fn wr<'a>(id: u64, op: WrOp, sges: &'a [Sge], remote: &Side, off: u64) -> Wr<'a> {
    Wr { id, op, sges, remote_addr: remote.mr.base() + off, rkey: remote.mr.rkey() }
}

#[test]
fn write_and_read_with_scatter_gather_lists_in_order() {
    let (mut a, b) = pair(1 << 16, RW);
    for (i, x) in a.buf.iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    // One WRITE gathering two pieces of a, one READ scattering b's bytes back into two pieces.
    let g = [sge(&a, 0, 1000), sge(&a, 5000, 24)];
    let s = [sge(&a, 20_000, 512), sge(&a, 30_000, 512)];
    let wrs = [wr(1, WrOp::Write, &g, &b, 100), wr(2, WrOp::Read, &s, &b, 100)];
    a.qp.post(&wrs).unwrap();
    let wcs = wait(&a.cq, 2);
    assert_eq!(
        wcs,
        [Wc { id: 1, status: WcStatus::Success }, Wc { id: 2, status: WcStatus::Success }]
    );
    let mut want = a.buf[..1000].to_vec();
    want.extend_from_slice(&a.buf[5000..5024]);
    assert_eq!(&b.buf[100..1124], &want[..]);
    assert_eq!(&a.buf[20_000..20_512], &want[..512]);
    assert_eq!(&a.buf[30_000..30_512], &want[512..]);
    assert_eq!(a.nic.counters().bytes, 2048);
}

#[test]
fn the_responder_refuses_bad_keys_bounds_and_access_then_the_qp_flushes() {
    let ro = MrAccess { local_write: true, remote_read: true, remote_write: false };
    for case in 0..3 {
        let (a, b) = pair(4096, ro);
        let g = [sge(&a, 0, 64)];
        let bad = match case {
            0 => Wr { rkey: b.mr.rkey() ^ 0xffff, ..wr(1, WrOp::Read, &g, &b, 0) },
            1 => wr(1, WrOp::Read, &g, &b, 4096 - 63),
            _ => wr(1, WrOp::Write, &g, &b, 0),
        };
        a.qp.post(&[bad, wr(2, WrOp::Read, &g, &b, 0)]).unwrap();
        let wcs = wait(&a.cq, 2);
        assert_eq!(wcs[0].status, WcStatus::RemoteAccess, "case {case}");
        assert_eq!(wcs[1].status, WcStatus::Flushed, "case {case}: RC stops at the error");
        assert_eq!(a.qp.state(), QpState::Error);
        assert!(b.buf.iter().all(|&x| x == 0));
    }
}

#[test]
fn a_read_into_memory_without_local_write_is_a_local_protection_error() {
    let fabric = SoftFabric::new();
    let ro = MrAccess { local_write: false, remote_read: true, remote_write: false };
    let (a, b) = (side(&fabric, 4096, ro), side(&fabric, 4096, RW));
    a.qp.connect(0, &addr(&b), &QpTiming::default()).unwrap();
    b.qp.connect(0, &addr(&a), &QpTiming::default()).unwrap();
    let g = [sge(&a, 0, 64)];
    a.qp.post(&[wr(1, WrOp::Read, &g, &b, 0)]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::LocalProtection);
}

#[test]
fn a_deregistered_key_is_refused_and_posting_needs_rts() {
    let (a, mut b) = pair(4096, RW);
    let g = [sge(&a, 0, 8)];
    let stale = wr(1, WrOp::Write, &g, &b, 0);
    let mr = std::mem::replace(&mut b.mr, Box::new(NoMr));
    drop(mr);
    assert_eq!(b.nic.mr_count(), 0);
    a.qp.post(&[stale]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess);
    let cq = a.nic.create_cq(4).unwrap();
    let fresh = a.nic.create_qp(&cq, QpCaps { max_send_wr: 4, max_sge: 1 }).unwrap();
    assert!(fresh.post(&[stale]).is_err(), "a QP in RESET takes no requests");
    let many: Vec<Wr<'_>> = (0..5).map(|i| Wr { id: i, ..stale }).collect();
    fresh.init().unwrap();
    fresh.connect(0, &addr(&b), &QpTiming::default()).unwrap();
    let (n, e) = fresh.post(&many).unwrap_err();
    assert_eq!(n, 4, "the send queue holds 4: {e}");
}

#[test]
fn injected_faults_and_a_vanished_peer_fail_with_their_statuses() {
    let (a, b) = pair(4096, RW);
    let g = [sge(&a, 0, 8)];
    a.nic.fail_next(1, WcStatus::RetryExceeded);
    a.qp.post(&[wr(1, WrOp::Write, &g, &b, 0)]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RetryExceeded);
    assert_eq!(a.nic.counters().errors, 1);

    let (a, b) = pair(4096, RW);
    b.nic.vanish();
    a.qp.post(&[wr(1, WrOp::Write, &g, &b, 0)]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RetryExceeded);
    assert!(b.nic.create_cq(1).is_err(), "nothing new on a vanished NIC");
    b.nic.restore();
    assert!(b.nic.create_cq(1).is_ok());

    let (a, b) = pair(4096, RW);
    a.nic.break_qps();
    assert_eq!(a.qp.state(), QpState::Error);
    a.qp.post(&[wr(7, WrOp::Write, &g, &b, 0)]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0], Wc { id: 7, status: WcStatus::Flushed });
}

#[test]
fn the_completion_channel_fires_once_armed() {
    let (a, b) = pair(4096, RW);
    let g = [sge(&a, 0, 8)];
    assert_eq!(a.cq.take_events().unwrap(), 0);
    a.cq.arm().unwrap();
    a.qp.post(&[wr(1, WrOp::Write, &g, &b, 0)]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.cq.take_events().unwrap() == 0 {
        assert!(Instant::now() < deadline, "no event");
        std::thread::sleep(Duration::from_micros(50));
    }
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    // Not armed: a completion makes no event.
    a.qp.post(&[wr(2, WrOp::Write, &g, &b, 0)]).unwrap();
    wait(&a.cq, 1);
    assert_eq!(a.cq.take_events().unwrap(), 0);
}

#[test]
fn dma_buf_registration_reaches_the_buffer_through_its_descriptor() {
    let fabric = SoftFabric::new();
    let a = side(&fabric, 4096, RW);
    let b = side(&fabric, 16, RW);
    a.qp.connect(0, &addr(&b), &QpTiming::default()).unwrap();
    b.qp.connect(0, &addr(&a), &QpTiming::default()).unwrap();
    // A memfd stands in for a GPU's dma-buf export.
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: our fresh descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizing our memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 8192) }, 0);
    // SAFETY: the memfd lives until the end of the test, past the MR.
    let mr = unsafe { b.nic.reg_dmabuf_mr(fd.as_raw_fd(), 4096, 4096, RW) }.unwrap();
    let mut a = a;
    a.buf[..5].copy_from_slice(b"hello");
    let g = [sge(&a, 0, 5)];
    let w = Wr { id: 1, op: WrOp::Write, sges: &g, remote_addr: mr.base() + 10, rkey: mr.rkey() };
    a.qp.post(&[w]).unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 5];
    // SAFETY: reading 5 bytes at offset 4106 of our memfd into a live buffer.
    let n = unsafe { libc::pread(fd.as_raw_fd(), got.as_mut_ptr().cast(), 5, 4106) };
    assert_eq!((n, &got), (5, b"hello"));
    drop(mr);
}
