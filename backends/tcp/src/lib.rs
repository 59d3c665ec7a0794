//! `tensorwire-tcp`: the portable backend for moving tensors between hosts over TCP.
//!
//! - **Separate data plane.** Each backend listens on its own data port (apart from the engine's
//!   control endpoint); its endpoint blob is that address. A connection to a peer is `streams`
//!   TCP streams, and ops larger than `piece_bytes` are cut into pieces spread over all streams,
//!   several in flight per stream ([`DEFAULT_PIECE`] says why pieces are 512 KiB).
//! - **No intermediate copies.** WRITE payloads are sent with `sendmsg` straight from the
//!   registered source and received with `recv` straight into the destination slice on the peer;
//!   READs the same way in the other direction. Headers are fixed 64-byte frames ([`wire`]).
//! - **Checked on the serving side.** Every inbound request goes through the engine's
//!   `BackendHost::resolve` (region, access key, permission, bounds, deregistration); a WRITE is
//!   acknowledged only after its bytes are in place. Refusals travel back as the same `Error`
//!   variant. Access keys are 128-bit random values a peer only learns from the engine
//!   handshake (authenticated with the cluster secret, or on loopback with the user's).
//! - **Nothing held by strangers.** A new data stream must send the data preamble and the
//!   backend's [`wire::Ticket`] (shown only in its endpoint blob, so only to a peer that passed
//!   the handshake) within [`TcpConfig::pending`]'s deadline; until then it is pending, and a
//!   source or the listener at its bound of pending streams loses its oldest to the newcomer
//!   (`tensorwire_proto::admission`). A stream that proved itself may idle (TCP keepalive ends
//!   it when its host vanishes); at most [`TcpConfig::max_streams`] are served at once. The
//!   accept loop backs off when the process runs out of descriptors.
//! - **Optional crc32c** per piece ([`TcpConfig::checksum`]), verified on receipt; a mismatch is
//!   [`Error::Checksum`], never success.
//! - **Dead peers surface.** A closed or reset stream fails every queued and pending op of its
//!   connection with `PeerClosed`; a stream that makes no progress for
//!   [`TcpConfig::stall_timeout`] while work is outstanding fails them with `Timeout`. TCP
//!   keepalive probes idle streams.
//!
//! ```no_run
//! # async fn demo() -> tensorwire_core::Result<()> {
//! use tensorwire_core::Engine;
//! use tensorwire_tcp::{TcpBackend, TcpConfig};
//! let engine = Engine::builder().backend(TcpBackend::new(TcpConfig::default())?).start().await?;
//! # Ok(()) }
//! ```

mod client;
mod io;
mod server;
pub mod wire;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::backend::kit::{Reader, Serving, WeakList, Writer};
use tensorwire_core::backend::{
    Backend, BackendHost, Capabilities, Connection, PeerBackendInfo, RegionInfo,
};
use tensorwire_core::{Error, RegionId, Result};
use tensorwire_proto::admission::{Admission, Limits};
use tokio::net::TcpStream;

use client::{ClientCfg, ConnShared, TcpConnection};
use wire::{TICKET_LEN, Ticket};

/// The backend's name in descriptors and telemetry.
pub const NAME: &str = "tcp";

/// TCP backend settings.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Data listener address (port 0 picks a free port). Default 127.0.0.1:0; bind a routable
    /// address (or 0.0.0.0 with `advertise`) for cross-host use.
    pub listen: SocketAddr,
    /// Address peers should dial, when it differs from the bound one (NAT, 0.0.0.0 binds).
    pub advertise: Option<SocketAddr>,
    /// Data streams per peer connection; large ops are striped across them.
    pub streams: usize,
    /// Largest piece of an op in one request frame (at most [`wire::MAX_PIECE`]); default
    /// [`DEFAULT_PIECE`].
    pub piece_bytes: u64,
    /// crc32c per piece, computed by the sender and verified by the receiver.
    pub checksum: bool,
    /// A stream with outstanding work and no progress for this long is declared dead.
    pub stall_timeout: Duration,
    /// Bounds on streams that have not yet sent the preamble and the ticket: how many per
    /// listener and per source address (the oldest goes when a bound is reached), and how
    /// long one may take. Default 256, 64 per source, 10 s.
    pub pending: Limits,
    /// Streams that proved themselves served at once; more are closed once proved (and
    /// warned about). Default 4,096.
    pub max_streams: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            streams: default_streams(),
            piece_bytes: DEFAULT_PIECE,
            checksum: false,
            stall_timeout: Duration::from_secs(30),
            pending: Limits::handshake(Duration::from_secs(10)),
            max_streams: 4096,
        }
    }
}

/// The default piece: 512 KiB. A piece is what a stream pipelines: each stream keeps up to four
/// in flight, so while the receiver copies one piece out of its socket the sender is already
/// copying the next one in, and both ends' copies run at once. With one piece per stream, a
/// receiver on a busy host starts only after the sender's whole send, and the two copies run one
/// after the other (4 MiB pieces made 4-16 MiB READs 10-30% slower). Smaller pieces cost more
/// headers and wake-ups than they gain: 256 KiB pieces were slower than 512 KiB at 1 and 4 MiB,
/// and 1 MiB pieces slower at 4 MiB (docs/decisions/0001-tcp-piece-size.md). 512 KiB is also the receive
/// low-water mark, so a piece lands in one wake-up.
pub const DEFAULT_PIECE: u64 = 512 << 10;

/// One stream per core, between 2 and 8: a single stream is bound by one core's copy speed.
pub fn default_streams() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8)
}

/// Enables TCP keepalive so an idle stream to a vanished host is eventually torn down.
fn keepalive(sock: &TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(sock).set_tcp_keepalive(&ka) {
        tracing::debug!(error = %e, "tcp: could not enable keepalive");
    }
}

#[derive(Debug)]
struct Inner {
    /// The data listener, the engine host, the accept loop and serving tasks.
    serving: Serving<std::net::TcpListener>,
    /// What a stream sends after its preamble (see [`wire::Ticket`]).
    ticket: Ticket,
    /// Streams not yet proved.
    admission: Admission,
    /// Streams served now that proved themselves.
    streams: Arc<AtomicUsize>,
    /// Outbound connections, killed at shutdown.
    conns: WeakList<ConnShared>,
}

impl Inner {
    fn close(&self) {
        self.serving.close();
        for c in self.conns.take() {
            c.kill(self.serving.closed_error());
        }
    }
}

/// The TCP backend (one per engine).
#[derive(Debug)]
pub struct TcpBackend {
    cfg: TcpConfig,
    local: SocketAddr,
    inner: Arc<Inner>,
}

impl TcpBackend {
    /// Binds the data listener; the backend starts serving when an engine attaches it.
    pub fn new(cfg: TcpConfig) -> Result<Arc<TcpBackend>> {
        if cfg.piece_bytes == 0 || cfg.piece_bytes > wire::MAX_PIECE {
            return Err(Error::InvalidArgument(format!(
                "tcp piece_bytes {} must be in 1..={}",
                cfg.piece_bytes,
                wire::MAX_PIECE
            )));
        }
        if cfg.streams == 0 || cfg.streams > 64 {
            return Err(Error::InvalidArgument(format!(
                "tcp streams {} must be in 1..=64",
                cfg.streams
            )));
        }
        let listener = std::net::TcpListener::bind(cfg.listen).map_err(|e| {
            Error::InvalidArgument(format!("tcp: cannot listen on {}: {e}", cfg.listen))
        })?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        Ok(Arc::new(TcpBackend {
            local,
            inner: Arc::new(Inner {
                serving: Serving::new(NAME, listener),
                ticket: Ticket::random(),
                admission: Admission::new("tcp data", cfg.pending),
                streams: Arc::default(),
                conns: WeakList::default(),
            }),
            cfg,
        }))
    }

    /// The data listener's bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Pending data streams held now (all, or from `source`).
    pub fn pending_streams(&self, source: Option<std::net::IpAddr>) -> usize {
        self.inner.admission.pending(source)
    }

    /// Data streams served now that proved themselves.
    pub fn served_streams(&self) -> usize {
        self.inner.streams.load(Ordering::Acquire)
    }

    fn client_cfg(&self) -> ClientCfg {
        ClientCfg {
            piece: self.cfg.piece_bytes,
            checksum: self.cfg.checksum,
            stall: self.cfg.stall_timeout,
        }
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        self.inner.close();
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, inner: Weak<Inner>, cfg: TcpConfig) {
    loop {
        let (sock, peer) = tensorwire_proto::accept::accept(&listener, "tcp data").await;
        let Some(inner) = inner.upgrade() else { return };
        if inner.serving.is_closed() {
            return;
        }
        let Some(host) = inner.serving.host() else { continue };
        let _ = sock.set_nodelay(true);
        keepalive(&sock);
        let stream = server::Stream {
            pending: inner.admission.admit(peer.ip()),
            ticket: inner.ticket,
            served: inner.streams.clone(),
            max_streams: cfg.max_streams,
        };
        inner.serving.spawn(server::serve(sock, host, cfg.stall_timeout, stream));
        // Let the streams just accepted read their tickets before more are accepted.
        tokio::task::yield_now().await;
    }
}

/// The endpoint blob: the data address and the stream ticket.
fn encode_endpoint(addr: SocketAddr, ticket: &Ticket) -> Bytes {
    let mut w = Writer::new();
    w.str(&addr.to_string()).raw(&ticket.0);
    Bytes::from(w.finish())
}

fn decode_endpoint(b: &[u8]) -> Result<(SocketAddr, Ticket)> {
    let mut r = Reader::new(b, "tcp endpoint");
    let s = r.str(128, "address")?;
    let mut t = [0u8; TICKET_LEN];
    t.copy_from_slice(r.raw(TICKET_LEN)?);
    r.finish()?;
    let addr =
        s.parse().map_err(|_| Error::protocol(format!("tcp endpoint: bad address {s:?}")))?;
    Ok((addr, Ticket(t)))
}

#[async_trait]
impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        // The peer's device memory is staged by the peer (through its engine's bounces); local
        // device memory is staged by this engine before the backend sees it.
        let mut c = Capabilities::host(false, 1 << 40);
        c.remote = tensorwire_core::MemoryKinds::ALL;
        c
    }

    async fn start(&self, host: Arc<dyn BackendHost>) -> Result<()> {
        let listener = self.inner.serving.start(host, tokio::net::TcpListener::from_std)?;
        let weak = Arc::downgrade(&self.inner);
        self.inner.serving.spawn(accept_loop(listener, weak, self.cfg.clone()));
        Ok(())
    }

    fn endpoint(&self) -> Bytes {
        encode_endpoint(self.cfg.advertise.unwrap_or(self.local), &self.inner.ticket)
    }

    async fn register(&self, _region: &RegionInfo) -> Result<Option<Bytes>> {
        // Any memory, served through BackendHost::resolve (device memory staged through the
        // engine's bounces): nothing to publish.
        Ok(Some(Bytes::new()))
    }

    async fn deregister(&self, _id: RegionId) -> Result<()> {
        Ok(())
    }

    async fn connect(&self, peer: &PeerBackendInfo) -> Result<Arc<dyn Connection>> {
        self.inner.serving.ensure_open()?;
        let (addr, ticket) = decode_endpoint(&peer.endpoint)?;
        let (conn, shared) = TcpConnection::open(addr, ticket, self.cfg.streams, self.client_cfg())
            .await
            .map_err(|e| match e {
                Error::Backend { .. } => {
                    Error::PeerClosed(format!("tcp: cannot reach {} at {addr}: {e}", peer.engine))
                }
                e => e,
            })?;
        self.inner.conns.push(&shared);
        Ok(Arc::new(conn))
    }

    fn stats(&self) -> Vec<(String, u64)> {
        // Summed over live connections, by stream index: how ops were spread over the streams.
        let mut per: Vec<(u64, u64)> = Vec::new();
        for c in self.inner.conns.live() {
            for (i, (pieces, bytes)) in c.stream_counts().into_iter().enumerate() {
                if per.len() <= i {
                    per.resize(i + 1, (0, 0));
                }
                per[i].0 += pieces;
                per[i].1 += bytes;
            }
        }
        per.into_iter()
            .enumerate()
            .flat_map(|(i, (p, b))| {
                [(format!("stream{i}.pieces"), p), (format!("stream{i}.bytes"), b)]
            })
            .collect()
    }

    async fn shutdown(&self) {
        self.inner.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trip_and_rejections() {
        let a: SocketAddr = "10.1.2.3:4567".parse().unwrap();
        let t = Ticket::random();
        assert_eq!(decode_endpoint(&encode_endpoint(a, &t)).unwrap(), (a, t));
        assert!(decode_endpoint(b"\x03\x00\x00\x00abc").is_err());
        assert!(decode_endpoint(&[0xff; 3]).is_err());
        // A blob of the version before (no ticket) is refused, and so is one with bytes after.
        let full = encode_endpoint(a, &t);
        assert!(decode_endpoint(&full[..full.len() - TICKET_LEN]).is_err());
        assert!(decode_endpoint(&[&full[..], b"x"].concat()).is_err());
    }

    #[test]
    fn config_is_checked() {
        let bad = TcpConfig { piece_bytes: 0, ..TcpConfig::default() };
        assert!(matches!(TcpBackend::new(bad), Err(Error::InvalidArgument(_))));
        let bad = TcpConfig { streams: 0, ..TcpConfig::default() };
        assert!(matches!(TcpBackend::new(bad), Err(Error::InvalidArgument(_))));
        assert!((2..=8).contains(&default_streams()));
    }
}
