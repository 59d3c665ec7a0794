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

/// The most a payload's receiver waits to have queued before it is woken (see [`LowWater`]).
const LOW_WATER: usize = 512 << 10;

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

/// Sends what the socket takes now of `parts` (address, length pairs; empty ones are
/// skipped), gathered into as few `sendmsg` calls as it allows, without waiting; `parts` is left
/// holding what is still to send. `Ok(true)` once everything is sent, `Ok(false)` when the socket
/// would block first.
///
/// # Safety
/// Each part must be readable for its length for the call.
pub(crate) unsafe fn try_send_parts<const N: usize>(
    sock: &TcpStream,
    parts: &mut [(usize, usize); N],
    dog: &mut Watchdog,
) -> Result<bool> {
    loop {
        let Some(first) = parts.iter().position(|p| p.1 > 0) else { return Ok(true) };
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
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        dog.progress();
        for p in parts[first..].iter_mut() {
            let k = n.min(p.1);
            (p.0, p.1, n) = (p.0 + k, p.1 - k, n - k);
        }
    }
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
    dog.progress();
    // SAFETY: this function's contract, for each call.
    while !unsafe { try_send_parts(sock, &mut parts, dog) }? {
        ready(sock, Interest::WRITABLE, dog, &|| true, what).await?;
    }
    Ok(())
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

/// A socket's receive low-water mark (`SO_RCVLOWAT`) raised while a payload is received: the
/// kernel then signals the socket readable once that many bytes are queued (or its buffer is under
/// pressure, or the stream ends), not for every segment, so the receiver wakes and runs for large
/// copies instead of competing with the sender's copies for a few kilobytes at a time. The mark
/// goes back to one byte when the guard drops, and never exceeds what is still to come, so the
/// bytes a peer has promised always reach it.
struct LowWater<'a> {
    sock: &'a TcpStream,
    at: usize,
}

impl<'a> LowWater<'a> {
    fn new(sock: &'a TcpStream) -> Self {
        LowWater { sock, at: 1 }
    }

    /// Sets the mark to `n` bytes (at least 1). A socket that refuses keeps its mark: the receive
    /// is then woken as often as without one, which is slower, never wrong.
    fn set(&mut self, n: usize) {
        let n = n.max(1);
        if n == self.at {
            return;
        }
        let v = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
        // SAFETY: sets an int option on the open socket behind `self.sock`; `v` outlives the call.
        let r = unsafe {
            libc::setsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            self.at = n;
        }
    }
}

impl Drop for LowWater<'_> {
    fn drop(&mut self) {
        self.set(1);
    }
}

/// Receives exactly `len` bytes into `[addr, addr+len)`. With a gate, each `recv` runs inside
/// `gate.run`, so after a cancel returns nothing more lands; the remaining bytes are drained.
/// While bytes are missing it waits for up to [`LOW_WATER`] of them at once ([`LowWater`]);
/// a peer that sends less than that within a watchdog tick is waited for byte by byte after,
/// so a slow peer still shows progress and a dead one is still found.
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
    let mut mark = LowWater::new(sock);
    let mut slow = false;
    dog.progress();
    while got < len {
        let res = match gate {
            Some(g) => match g.run(|| recv_once(sock, addr + got, len - got)) {
                Some(r) => r,
                None => {
                    drop(mark);
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
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && !slow => {
                mark.set((len - got).min(LOW_WATER));
                match tokio::time::timeout(dog.tick(), sock.ready(Interest::READABLE)).await {
                    Ok(r) => {
                        r?;
                    }
                    Err(_) => {
                        // Under the mark for a whole tick: a slow peer. Wake for every byte
                        // from here on (setting the mark signals what is queued already).
                        mark.set(1);
                        slow = true;
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    fn low_water(sock: &TcpStream) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut n = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reads an int option of the open socket into `v`, `n` bytes long.
        let r = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&mut v as *mut libc::c_int).cast(),
                &mut n,
            )
        };
        assert_eq!(r, 0);
        v
    }

    /// A payload sent in parts 300 ms apart, each far below the low-water mark, lands whole with
    /// a 400 ms stall bound: the receiver wakes for every byte once a tick (50 ms) passed under
    /// the mark, so each part counts as progress (waiting for the mark, it would see none for
    /// 900 ms and call the peer dead). The mark is back to one byte afterwards, so the next
    /// header wakes its reader.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_payload_lands_and_the_mark_comes_back() {
        let (mut tx, rx) = pair().await;
        let len = 40_000usize;
        let data: Vec<u8> = (0..len).map(|i| (i % 239) as u8).collect();
        let sender = tokio::spawn({
            let data = data.clone();
            async move {
                for (k, part) in data.chunks(len / 4).enumerate() {
                    if k > 0 {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    tx.write_all(part).await.unwrap();
                }
                tx.write_all(b"next").await.unwrap();
                tx
            }
        });
        let mut dog = Watchdog::new(Duration::from_millis(400));
        let mut out = vec![0u8; len];
        // SAFETY: `out` is writable for `len` bytes and outlives the call.
        let landed =
            unsafe { recv_into(&rx, out.as_mut_ptr() as usize, len as u64, None, &mut dog, "t") }
                .await
                .unwrap();
        assert_eq!(landed, Landed::All);
        assert!(out == data);
        assert_eq!(low_water(&rx), 1);
        let mut next = [0u8; 4];
        assert!(recv_buf(&rx, &mut next, &mut dog, &|| true, "t").await.unwrap());
        assert_eq!(&next, b"next");
        drop(sender.await.unwrap());
    }

    /// A payload that arrives at once lands with the mark raised, and the mark is reset.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_payload_lands_with_the_mark_raised() {
        let (mut tx, rx) = pair().await;
        let len = 3 * LOW_WATER + 123;
        let data: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
        let sender = tokio::spawn({
            let data = data.clone();
            async move {
                tx.write_all(&data).await.unwrap();
                tx
            }
        });
        let mut dog = Watchdog::new(Duration::from_secs(10));
        let mut out = vec![0u8; len];
        // SAFETY: `out` is writable for `len` bytes and outlives the call.
        unsafe { recv_into(&rx, out.as_mut_ptr() as usize, len as u64, None, &mut dog, "t") }
            .await
            .unwrap();
        assert!(out == data);
        assert_eq!(low_water(&rx), 1);
        drop(sender.await.unwrap());
    }
}
