//! The raw-socket baseline for tcp: `streams` plain tokio `TcpStream`s on loopback moving the same
//! bytes with the same completion semantics as a tensorwire op. A WRITE sends a 9-byte header and
//! its share of the bytes on every stream, and completes when every stream's receiver has read its
//! share and answered one byte; a READ sends a 9-byte request on every stream and completes when
//! every share has been read. Each stream is driven by its own task, as tensorwire's are.
//!
//! With [`set_linger`] on (`xfer --linger-baseline`), the pair arms the process's linger
//! (`tensorwire_core::linger`) where tensorwire's engine does: when it starts an op and when
//! it serves a request, so both sides keep their workers awake alike.

use crate::Result;
use tensorwire_core::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

static LINGER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the pair arms the linger as the engine does (off by default: a plain socket pair).
pub fn set_linger(on: bool) {
    LINGER.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_linger`] is on.
pub fn lingers() -> bool {
    LINGER.load(std::sync::atomic::Ordering::Relaxed)
}

fn arm() {
    if lingers() {
        tensorwire_core::linger::arm();
    }
}

const OP_WRITE: u8 = 1;
const OP_READ: u8 = 2;

fn io(e: std::io::Error) -> Error {
    Error::from(e)
}

/// Connected stream pairs with a page-touched buffer on each end.
#[derive(Debug)]
pub struct RawTcp {
    streams: Vec<Option<(TcpStream, Vec<u8>)>>,
    servers: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RawTcp {
    fn drop(&mut self) {
        self.servers.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

async fn serve(mut s: TcpStream, mut buf: Vec<u8>) {
    let mut hdr = [0u8; 9];
    loop {
        if s.read_exact(&mut hdr).await.is_err() {
            return;
        }
        arm();
        let len = u64::from_le_bytes(hdr[1..9].try_into().unwrap_or_default()) as usize;
        let len = len.min(buf.len());
        let r = match hdr[0] {
            OP_WRITE => match s.read_exact(&mut buf[..len]).await {
                Ok(_) => s.write_all(&[1]).await,
                Err(e) => Err(e),
            },
            _ => s.write_all(&buf[..len]).await,
        };
        if r.is_err() {
            return;
        }
    }
}

/// Bytes each stream's buffer holds.
fn per_stream(streams: usize, max: u64) -> usize {
    max.div_ceil(streams.max(1) as u64) as usize
}

/// One client stream with its buffer.
async fn dial(
    addr: std::net::SocketAddr,
    streams: usize,
    max: u64,
) -> Result<(TcpStream, Vec<u8>)> {
    let c = TcpStream::connect(addr).await.map_err(io)?;
    c.set_nodelay(true).map_err(io)?;
    Ok((c, vec![4u8; per_stream(streams, max)]))
}

/// Splits `size` into `n` contiguous shares.
fn shares(size: u64, n: usize) -> Vec<u64> {
    let n64 = n as u64;
    (0..n64).map(|i| size / n64 + u64::from(i < size % n64)).collect()
}

impl RawTcp {
    /// Opens `streams` connected pairs able to move up to `max` bytes per op.
    pub async fn new(streams: usize, max: u64) -> Result<RawTcp> {
        let l = TcpListener::bind("127.0.0.1:0").await.map_err(io)?;
        let addr = l.local_addr().map_err(io)?;
        let mut out = RawTcp { streams: Vec::new(), servers: Vec::new() };
        for _ in 0..streams {
            let c = dial(addr, streams, max).await?;
            let (s, _) = l.accept().await.map_err(io)?;
            s.set_nodelay(true).map_err(io)?;
            out.servers.push(tokio::spawn(serve(s, vec![3u8; per_stream(streams, max)])));
            out.streams.push(Some(c));
        }
        Ok(out)
    }

    /// Opens `streams` streams to a server of [`RawTcp::serve_at`] in another process.
    pub async fn connect(addr: std::net::SocketAddr, streams: usize, max: u64) -> Result<RawTcp> {
        let mut out = RawTcp { streams: Vec::new(), servers: Vec::new() };
        for _ in 0..streams {
            out.streams.push(Some(dial(addr, streams, max).await?));
        }
        Ok(out)
    }

    /// Serves every stream accepted on `l` for clients moving up to `max` bytes per op (each
    /// stream's buffer holds a whole op, whatever the client's streams), until the task is
    /// dropped.
    pub async fn serve_at(l: TcpListener, max: u64) {
        while let Ok((s, _)) = l.accept().await {
            if s.set_nodelay(true).is_ok() {
                tokio::spawn(serve(s, vec![3u8; per_stream(1, max)]));
            }
        }
    }

    /// One op of `size` bytes in direction `op`, striped over every stream.
    pub async fn op(&mut self, write: bool, size: u64) -> Result<()> {
        arm();
        let parts = shares(size, self.streams.len());
        let mut tasks = Vec::with_capacity(parts.len());
        for (slot, share) in self.streams.iter_mut().zip(parts) {
            let (mut s, mut buf) = slot.take().ok_or_else(|| Error::protocol("raw stream lost"))?;
            tasks.push(tokio::spawn(async move {
                let n = share as usize;
                let mut hdr = [0u8; 9];
                hdr[0] = if write { OP_WRITE } else { OP_READ };
                hdr[1..].copy_from_slice(&share.to_le_bytes());
                let r: std::io::Result<()> = async {
                    s.write_all(&hdr).await?;
                    if write {
                        s.write_all(&buf[..n]).await?;
                        let mut ack = [0u8; 1];
                        s.read_exact(&mut ack).await?;
                    } else {
                        s.read_exact(&mut buf[..n]).await?;
                    }
                    Ok(())
                }
                .await;
                (s, buf, r)
            }));
        }
        self.rejoin(tasks).await
    }
}

/// A stream's task hands back its stream, its buffer and how its share went.
type StreamTask = tokio::task::JoinHandle<(TcpStream, Vec<u8>, std::io::Result<()>)>;

impl RawTcp {
    /// Waits for every stream's task and puts each stream back; the first error, if any.
    async fn rejoin(&mut self, tasks: Vec<StreamTask>) -> Result<()> {
        let mut result = Ok(());
        for (slot, t) in self.streams.iter_mut().zip(tasks) {
            let (s, buf, r) = t.await.map_err(|e| Error::protocol(e.to_string()))?;
            *slot = Some((s, buf));
            if let Err(e) = r {
                result = Err(io(e));
            }
        }
        Ok(result?)
    }

    /// `n` ops of `size` bytes each in direction `op`, pipelined: each stream takes its share of
    /// the ops, sends every request of it (with its bytes, for a WRITE) while it receives the
    /// answers, and the batch completes when every answer is in (what an engine does with a
    /// batch of small ops on a connection: no op waits for the one before it).
    pub async fn batch(&mut self, write: bool, size: u64, n: usize) -> Result<()> {
        arm();
        let k = self.streams.len();
        let mut tasks = Vec::with_capacity(k);
        for (i, slot) in self.streams.iter_mut().enumerate() {
            let (mut s, mut buf) = slot.take().ok_or_else(|| Error::protocol("raw stream lost"))?;
            let ops = n / k + usize::from(i < n % k);
            tasks.push(tokio::spawn(async move {
                let len = size as usize;
                let mut hdr = [0u8; 9];
                hdr[0] = if write { OP_WRITE } else { OP_READ };
                hdr[1..].copy_from_slice(&size.to_le_bytes());
                let r: std::io::Result<()> = async {
                    let (mut rx, mut tx) = s.split();
                    let half = len.min(buf.len() / 2);
                    let (src, dst) = buf.split_at_mut(half);
                    let send = async {
                        for _ in 0..ops {
                            tx.write_all(&hdr).await?;
                            if write {
                                tx.write_all(&src[..len]).await?;
                            }
                        }
                        Ok::<(), std::io::Error>(())
                    };
                    let recv = async {
                        for _ in 0..ops {
                            if write {
                                let mut ack = [0u8; 1];
                                rx.read_exact(&mut ack).await?;
                            } else {
                                rx.read_exact(&mut dst[..len]).await?;
                            }
                        }
                        Ok::<(), std::io::Error>(())
                    };
                    tokio::try_join!(send, recv).map(drop)
                }
                .await;
                (s, buf, r)
            }));
        }
        self.rejoin(tasks).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_size() {
        assert_eq!(shares(10, 3), vec![4, 3, 3]);
        assert_eq!(shares(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(shares(1 << 20, 2).iter().sum::<u64>(), 1 << 20);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn moves_bytes_both_ways() {
        let mut r = RawTcp::new(2, 1 << 20).await.unwrap();
        r.op(true, 1 << 20).await.unwrap();
        r.op(false, 1 << 20).await.unwrap();
        r.op(false, 3).await.unwrap();
        r.batch(true, 4096, 33).await.unwrap();
        r.batch(false, 4096, 33).await.unwrap();
    }
}
