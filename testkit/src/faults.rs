//! A userspace fault proxy (this kernel has no `tc netem`): a TCP forwarder on loopback put
//! between two processes' sockets that delays, throttles, holds (a partition: nothing passes in
//! either direction until it heals, as TCP retransmission would deliver it then), corrupts, or
//! resets every open connection. Point a peer at [`FaultProxy::addr`] instead of the real address
//! (e.g. a tcp backend's `advertise`, a store or orchestrator address).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// What happens to the bytes passing through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// They pass as they are.
    None,
    /// Each read is held this long before it is forwarded.
    Delay(Duration),
    /// At most this many bytes per second, each direction of each connection.
    Throttle(u64),
    /// Nothing passes, and connections stay open (a partition); held bytes flow once healed.
    Partition,
    /// One bit of every `every`-th byte is flipped (data corruption on the wire).
    Corrupt {
        /// Period in bytes (at least 1).
        every: u64,
    },
}

#[derive(Debug)]
struct Shared {
    fault: watch::Sender<Fault>,
    /// Incremented by [`FaultProxy::reset_all`]; a connection opened before resets itself.
    resets: watch::Sender<u64>,
    forwarded: AtomicU64,
}

/// A running proxy to one target; dropping it closes its listener and every connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    _tasks: JoinSet<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards each connection to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<FaultProxy> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let shared = Arc::new(Shared {
            fault: watch::Sender::new(Fault::None),
            resets: watch::Sender::new(0),
            forwarded: AtomicU64::new(0),
        });
        let mut tasks = JoinSet::new();
        let s = shared.clone();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    a = l.accept() => {
                        let Ok((client, _)) = a else { continue };
                        conns.spawn(connection(client, target, s.clone()));
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(FaultProxy { addr, shared, _tasks: tasks })
    }

    /// The address to dial instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Applies `f` from now on, to open and new connections alike.
    pub fn set(&self, f: Fault) {
        self.shared.fault.send_replace(f);
    }

    /// Resets (RST) every connection open now, both sides; later ones are unaffected.
    pub fn reset_all(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }

    /// Bytes forwarded so far (both directions).
    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::Relaxed)
    }
}

async fn connection(client: TcpStream, target: SocketAddr, s: Arc<Shared>) {
    let mut resets = s.resets.subscribe();
    resets.borrow_and_update();
    let Ok(server) = TcpStream::connect(target).await else { return };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let fds = [client.as_raw_fd(), server.as_raw_fd()];
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let mut up = tokio::spawn(pump(cr, sw, s.clone()));
    let mut down = tokio::spawn(pump(sr, cw, s.clone()));
    tokio::select! {
        _ = resets.changed() => {
            // Both sockets are alive here: running pumps hold their halves, and finished ones
            // return them in their output, which is still in its join handle.
            for fd in fds {
                let off = libc::linger { l_onoff: 1, l_linger: 0 };
                // SAFETY: `fd` is an open socket owned by a half still alive (see above); the
                // option value is a local `linger` of the size passed.
                unsafe {
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        (&off as *const libc::linger).cast(),
                        std::mem::size_of::<libc::linger>() as libc::socklen_t,
                    );
                }
            }
            // Dropping the sockets now sends each side a RST rather than an orderly end.
            up.abort();
            down.abort();
        }
        _ = async { let _ = (&mut up).await; let _ = (&mut down).await; } => {}
    }
}

/// Copies `from` to `to` through the current fault until either side ends; returns the halves
/// (for a reset).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    s: Arc<Shared>,
) -> (OwnedReadHalf, OwnedWriteHalf) {
    let mut buf = vec![0u8; 64 << 10];
    let mut fault = s.fault.subscribe();
    let mut seen = 0u64;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                // An orderly end crosses a partition only once it heals, like the bytes.
                while *fault.borrow_and_update() == Fault::Partition {
                    if fault.changed().await.is_err() {
                        break;
                    }
                }
                let _ = to.shutdown().await;
                break;
            }
            Ok(n) => n,
        };
        loop {
            let f = *fault.borrow_and_update();
            match f {
                Fault::Partition => {
                    let _ = fault.changed().await; // hold until healed
                    continue;
                }
                Fault::Delay(d) => tokio::time::sleep(d).await,
                Fault::Throttle(rate) => {
                    let secs = n as f64 / rate.max(1) as f64;
                    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                }
                Fault::Corrupt { every } => {
                    let every = every.max(1);
                    for (i, b) in buf[..n].iter_mut().enumerate() {
                        if (seen + i as u64 + 1) % every == 0 {
                            *b ^= 0x10;
                        }
                    }
                }
                Fault::None => {}
            }
            break;
        }
        seen += n as u64;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        s.forwarded.fetch_add(n as u64, Ordering::Relaxed);
    }
    (from, to)
}
