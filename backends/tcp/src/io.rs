//! Socket I/O straight between a tokio `TcpStream` and raw memory: `sendmsg` gathers a header and a
//! region slice into one call, `recv` lands payload bytes in the destination region. No
//! payload-sized buffer exists anywhere; the only scratch buffer is a small one for draining bytes
//! nobody wants (a refused WRITE, a cancelled READ).
//!
//! Every wait for readiness is sliced into ticks; at each tick a [`Watchdog`] decides whether the
//! lack of progress means a dead peer, so no wait is unbounded while work is outstanding.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use tensorwire_core::backend::kit::CancelGate;
use tensorwire_core::{Error, Result};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Size of the drain buffer.
const SCRATCH: usize = 64 << 10;

/// Decides whether a stream that has made no progress for a while is dead.
#[derive(Debug)]
pub(crate) struct Watchdog {
    stall: Duration,
    last: Instant,
}

impl Watchdog {
    /// A watchdog declaring death after `stall` without progress while work is outstanding.
    pub(crate) fn new(stall: Duration) -> Self {
        Watchdog { stall, last: Instant::now() }
    }

    /// Records progress.
    pub(crate) fn progress(&mut self) {
        self.last = Instant::now();
    }

    /// Called at each tick of a wait; `busy` says whether anything is outstanding.
    fn check(&mut self, busy: bool, what: &str) -> Result<()> {
        if !busy {
            self.last = Instant::now();
            return Ok(());
        }
        if self.last.elapsed() >= self.stall {
            return Err(Error::timeout(format!("tcp: no progress on {what}"), self.stall));
        }
        Ok(())
    }

    fn tick(&self) -> Duration {
        (self.stall / 8).max(Duration::from_millis(10))
    }
}

/// Waits until `sock` is ready for `interest`, consulting the watchdog at every tick.
async fn ready(
    sock: &TcpStream,
    interest: Interest,
    dog: &mut Watchdog,
    busy: &(dyn Fn() -> bool + Sync),
    what: &str,
) -> Result<()> {
    loop {
        match tokio::time::timeout(dog.tick(), sock.ready(interest)).await {
            Ok(r) => {
                r?;
                return Ok(());
            }
            Err(_) => dog.check(busy(), what)?,
        }
    }
}

fn closed(what: &str) -> Error {
    Error::PeerClosed(format!("tcp: peer closed the stream during {what}"))
}

/// Sends every byte of `parts` (address, length pairs; empty ones are skipped), gathering them into
/// as few `sendmsg` calls as the socket allows.
///
/// # Safety
/// Each part must be readable for its length until this future completes or is dropped.
pub(crate) async unsafe fn send_parts<const N: usize>(
    sock: &TcpStream,
    mut parts: [(usize, usize); N],
    dog: &mut Watchdog,
    what: &str,
) -> Result<()> {
    let mut first = 0;
    dog.progress();
    loop {
        while first < N && parts[first].1 == 0 {
            first += 1;
        }
        if first == N {
            return Ok(());
        }
        let res = sock.try_io(Interest::WRITABLE, || {
            let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; N];
            for (v, &(a, l)) in iov.iter_mut().zip(&parts[first..]) {
                *v = libc::iovec { iov_base: a as *mut libc::c_void, iov_len: l };
            }
            // SAFETY: a zeroed msghdr is valid (null name, no control data).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = (N - first) as _;
            // SAFETY: the fd is the open socket behind `sock`; the iovecs point at memory the
            // caller keeps readable (this function's contract).
            let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
        });
        let mut n = match res {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                ready(sock, Interest::WRITABLE, dog, &|| true, what).await?;
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        dog.progress();
        while n > 0 && first < N {
            let p = &mut parts[first];
            if n >= p.1 {
                n -= p.1;
                p.1 = 0;
                first += 1;
            } else {
                p.0 += n;
                p.1 -= n;
                n = 0;
            }
        }
    }
}

/// One `recv` into `[addr, addr+len)`; `Ok(0)` means end of stream.
fn recv_once(sock: &TcpStream, addr: usize, len: usize) -> std::io::Result<usize> {
    sock.try_io(Interest::READABLE, || {
        // SAFETY: callers pass memory writable for `len` bytes (see `recv_into`/`recv_buf`).
        let n = unsafe { libc::recv(sock.as_raw_fd(), addr as *mut libc::c_void, len, 0) };
        if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
    })
}

/// How a [`recv_into`] ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Landed {
    /// Every byte is in place.
    All,
    /// The gate was cancelled part-way; the rest was drained and discarded.
    Cancelled,
}

/// Receives exactly `len` bytes into `[addr, addr+len)`. With a gate, each `recv` runs inside
/// `gate.run`, so after a cancel returns nothing more lands; the remaining bytes are drained.
///
/// # Safety
/// `[addr, addr+len)` must stay writable until this future completes or is dropped, or (with a
/// gate) until the gate is cancelled.
pub(crate) async unsafe fn recv_into(
    sock: &TcpStream,
    addr: usize,
    len: u64,
    gate: Option<&CancelGate>,
    dog: &mut Watchdog,
    what: &str,
) -> Result<Landed> {
    let len = usize::try_from(len).map_err(|_| Error::protocol("tcp: payload exceeds usize"))?;
    let mut got = 0usize;
    dog.progress();
    while got < len {
        let res = match gate {
            Some(g) => match g.run(|| recv_once(sock, addr + got, len - got)) {
                Some(r) => r,
                None => {
                    drain(sock, (len - got) as u64, dog, what).await?;
                    return Ok(Landed::Cancelled);
                }
            },
            None => recv_once(sock, addr + got, len - got),
        };
        match res {
            Ok(0) => return Err(closed(what)),
            Ok(n) => {
                got += n;
                dog.progress();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                ready(sock, Interest::READABLE, dog, &|| true, what).await?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Landed::All)
}

/// Fills `buf` completely. While nothing of it has arrived and `busy()` is false, waits without
/// a bound (an idle stream); returns `Ok(false)` if the stream ends cleanly before the first byte.
pub(crate) async fn recv_buf(
    sock: &TcpStream,
    buf: &mut [u8],
    dog: &mut Watchdog,
    busy: &(dyn Fn() -> bool + Sync),
    what: &str,
) -> Result<bool> {
    let mut got = 0usize;
    while got < buf.len() {
        let rest = &mut buf[got..];
        match recv_once(sock, rest.as_mut_ptr() as usize, rest.len()) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(closed(what)),
            Ok(n) => {
                got += n;
                dog.progress();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Idle (nothing of this buffer yet) waits under `busy`; mid-buffer always counts.
                let busy: &(dyn Fn() -> bool + Sync) = if got == 0 { busy } else { &|| true };
                ready(sock, Interest::READABLE, dog, busy, what).await?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Reads and discards `len` bytes through a small scratch buffer.
pub(crate) async fn drain(
    sock: &TcpStream,
    len: u64,
    dog: &mut Watchdog,
    what: &str,
) -> Result<()> {
    let mut scratch = vec![0u8; SCRATCH.min(usize::try_from(len).unwrap_or(SCRATCH))];
    let mut left = len;
    while left > 0 {
        let n = scratch.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if !recv_buf(sock, &mut scratch[..n], dog, &|| true, what).await? {
            return Err(closed(what));
        }
        left -= n as u64;
    }
    Ok(())
}
