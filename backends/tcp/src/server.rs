//! The serving side: one task per accepted data stream. A stream is pending until it sent the
//! preamble and the backend's ticket (bounded in time and number by the backend's admission);
//! then each request is checked through the
//! engine's `BackendHost::resolve` (region, key, permission, bounds, deregistration) before any
//! byte moves; WRITE payloads land straight in the resolved slice and are acknowledged only once in
//! place; READs are answered from the slice with one gathered send. A refused WRITE's payload is
//! drained, so the stream stays usable.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::backend::kit::{copy_blocking, encode_error};
use tensorwire_core::{Error, MemSlice, Result, backend::Access, backend::BackendHost};
use tokio::net::TcpStream;

use crate::io::{self, Watchdog};
use tensorwire_proto::admission::Pending;

use crate::wire::{DataHeader, HEADER_LEN, Kind, PREAMBLE, TICKET_LEN, Ticket, check_preamble};

/// What the accept loop gives a stream's task besides its socket.
#[derive(Debug)]
pub(crate) struct Stream {
    /// Its place among the pending streams, given back once it proved itself.
    pub(crate) pending: Pending,
    /// What it must send after the preamble.
    pub(crate) ticket: Ticket,
    /// Streams served now that proved themselves (this one counts from its proof to its end).
    pub(crate) served: Arc<AtomicUsize>,
    /// The bound on `served`.
    pub(crate) max_streams: usize,
}

/// A place among the served streams, given back on drop.
struct Served(Arc<AtomicUsize>);

impl Drop for Served {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// crc32c of a slice of registered memory.
pub(crate) fn crc_of(slice: &MemSlice) -> u32 {
    // SAFETY: the slice is live registered host memory of `len` bytes, held by `slice`; other
    // transfers may write it concurrently, as with a NIC reading it, which only affects the value.
    let bytes = unsafe { std::slice::from_raw_parts(slice.ptr(), slice.len() as usize) };
    crc32c::crc32c(bytes)
}

/// Serves one accepted stream until the client closes it or breaks the protocol.
pub(crate) async fn serve(
    sock: TcpStream,
    host: Arc<dyn BackendHost>,
    stall: Duration,
    mut stream: Stream,
) {
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let limit = stream.pending.deadline();
    let opened = match stream.pending.prove(open(&sock, &stream.ticket, stall)).await {
        Ok(r) => r,
        Err(closed) => Err(closed.error("tcp data stream", limit)),
    };
    if let Err(e) = opened {
        return tracing::debug!(%peer, error = %e, "tcp data stream closed before it proved itself");
    }
    stream.pending.proved();
    let served = Served(stream.served.clone());
    if stream.served.fetch_add(1, Ordering::AcqRel) >= stream.max_streams {
        return tracing::warn!(%peer, max = stream.max_streams,
            "tcp data stream refused: the backend serves its most streams already");
    }
    if let Err(e) = serve_requests(&sock, host, stall).await {
        if !matches!(e, Error::PeerClosed(_)) {
            tracing::warn!(%peer, error = %e, "tcp data stream closed");
        }
    }
    drop(served);
}

/// A new stream's opening: the client's preamble and ticket, then this side's preamble. A
/// stream that opens with anything else is closed unanswered.
async fn open(sock: &TcpStream, ticket: &Ticket, stall: Duration) -> Result<()> {
    let mut dog = Watchdog::new(stall);
    let mut pre = [0u8; 8 + TICKET_LEN];
    if !io::recv_buf(sock, &mut pre, &mut dog, &|| true, "preamble").await? {
        return Err(Error::PeerClosed("tcp data: the stream closed before its preamble".into()));
    }
    let (p, t) = pre.split_at(8);
    check_preamble(p.try_into().unwrap_or(&[0; 8]))?;
    if !ticket.matches(t.try_into().unwrap_or(&[0; TICKET_LEN])) {
        return Err(Error::AccessDenied(
            "tcp data: the stream's ticket is not this backend's (a peer must learn the \
             endpoint in an engine handshake)"
                .into(),
        ));
    }
    // SAFETY: PREAMBLE is a static readable for its length.
    unsafe { io::send_parts(sock, [(PREAMBLE.as_ptr() as usize, 8)], &mut dog, "preamble") }.await
}

async fn serve_requests(
    sock: &TcpStream,
    host: Arc<dyn BackendHost>,
    stall: Duration,
) -> Result<()> {
    let mut dog = Watchdog::new(stall);
    let mut hbuf = [0u8; HEADER_LEN];
    loop {
        if !io::recv_buf(sock, &mut hbuf, &mut dog, &|| false, "request header").await? {
            return Ok(()); // the client closed an idle stream
        }
        let h = DataHeader::decode(&hbuf)?;
        match h.kind {
            Kind::WriteReq => serve_write(sock, &*host, &h, &mut dog).await?,
            Kind::ReadReq => serve_read(sock, &*host, &h, &mut dog).await?,
            Kind::Notify => serve_notify(sock, &*host, &h, &mut dog).await?,
            k => return Err(Error::protocol(format!("tcp data: client sent a {k:?}"))),
        }
    }
}

async fn respond(
    sock: &TcpStream,
    kind: Kind,
    id: u64,
    r: Result<()>,
    dog: &mut Watchdog,
) -> Result<()> {
    let body = match &r {
        Ok(()) => Vec::new(),
        Err(e) => encode_error(e),
    };
    let h = DataHeader::response(kind, id, r.is_ok(), body.len() as u64).encode();
    // SAFETY: `h` and `body` are locals that outlive the send.
    unsafe {
        io::send_parts(
            sock,
            [(h.as_ptr() as usize, h.len()), (body.as_ptr() as usize, body.len())],
            dog,
            "response",
        )
    }
    .await
}

fn what(h: &DataHeader, op: &str) -> String {
    format!("tcp {op} of region {} [{}, +{})", h.region.0, h.offset, h.len)
}

fn verify(slice: &MemSlice, h: &DataHeader, op: &str) -> Result<()> {
    match h.crc() {
        Some(expected) => {
            let actual = crc_of(slice);
            if actual == expected {
                Ok(())
            } else {
                Err(Error::Checksum { what: what(h, op), expected, actual })
            }
        }
        None => Ok(()),
    }
}

async fn serve_write(
    sock: &TcpStream,
    host: &dyn BackendHost,
    h: &DataHeader,
    dog: &mut Watchdog,
) -> Result<()> {
    let result = match host.resolve(h.range(), Access::Write) {
        Ok(slice) if !slice.kind().is_host() => write_device(sock, host, &slice, h, dog).await?,
        Ok(slice) => {
            // SAFETY: `slice` is a resolved, bounds-checked window of `h.len` bytes of registered
            // memory, held (and so kept mapped and registered) until this block ends.
            unsafe { io::recv_into(sock, slice.ptr() as usize, h.len, None, dog, "WRITE payload") }
                .await?;
            verify(&slice, h, "WRITE")
        }
        Err(e) => {
            io::drain(sock, h.len, dog, "refused WRITE payload").await?;
            Err(e)
        }
    };
    respond(sock, Kind::WriteAck, h.id, result, dog).await
}

async fn serve_read(
    sock: &TcpStream,
    host: &dyn BackendHost,
    h: &DataHeader,
    dog: &mut Watchdog,
) -> Result<()> {
    // A notice comes first: delivered before the READ is served, its refusal is the READ's answer.
    if h.notice > 0 {
        let notice = recv_message(sock, u64::from(h.notice), dog, "READ notice").await?;
        if let Err(e) = host.deliver(notice) {
            return respond(sock, Kind::ReadResp, h.id, Err(e), dog).await;
        }
    }
    let slice = match host.resolve(h.range(), Access::Read) {
        Ok(s) if !s.kind().is_host() => return read_device(sock, host, &s, h, dog).await,
        Ok(s) => s,
        Err(e) => return respond(sock, Kind::ReadResp, h.id, Err(e), dog).await,
    };
    let mut resp = DataHeader::response(Kind::ReadResp, h.id, true, h.len);
    if h.crc().is_some() {
        resp = resp.with_crc(crc_of(&slice));
    }
    let hb = resp.encode();
    // SAFETY: `hb` is a local and `slice` holds `h.len` readable bytes of registered memory until
    // the send completes.
    unsafe {
        io::send_parts(
            sock,
            [(hb.as_ptr() as usize, hb.len()), (slice.ptr() as usize, h.len as usize)],
            dog,
            "READ payload",
        )
    }
    .await
}

/// A WRITE into device memory: the payload lands in a bounce (pinned host memory), half by
/// half, and each half is copied to the device while the next one is received. Returns the
/// op's outcome (the stream is fine either way) or a stream error.
async fn write_device(
    sock: &TcpStream,
    host: &dyn BackendHost,
    slice: &MemSlice,
    h: &DataHeader,
    dog: &mut Watchdog,
) -> Result<Result<()>> {
    let bounce = match host.bounce().await {
        Ok(b) => b,
        Err(e) => {
            io::drain(sock, h.len, dog, "refused WRITE payload").await?;
            return Ok(Err(e));
        }
    };
    let half = bounce.len() / 2;
    let mut crc = 0u32;
    let mut copying: Option<tokio::task::JoinHandle<Result<bool>>> = None;
    let mut failed: Option<Error> = None;
    let (mut at, mut k) = (0u64, 0u64);
    while at < h.len {
        let n = half.min(h.len - at);
        let part = bounce.sub((k % 2) * half, n)?;
        // SAFETY: `part` is `n` bytes of the bounce's pinned host memory, which this function
        // owns; the copy that last read this half has been awaited (one half in flight at most).
        unsafe { io::recv_into(sock, part.ptr() as usize, n, None, dog, "WRITE payload") }.await?;
        if h.crc().is_some() {
            crc = part.with_host_bytes(|b| crc32c::crc32c_append(crc, b))?;
        }
        if let Some(c) = copying.take() {
            if let Err(e) = join(c).await {
                failed.get_or_insert(e);
            }
        }
        if failed.is_none() {
            let dst = slice.sub(at, n)?;
            copying = Some(tokio::spawn(copy_blocking(dst, part, None)));
        }
        at += n;
        k += 1;
    }
    if let Some(c) = copying {
        if let Err(e) = join(c).await {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        return Ok(Err(e));
    }
    match h.crc() {
        Some(expected) if expected != crc => {
            Ok(Err(Error::Checksum { what: what(h, "WRITE"), expected, actual: crc }))
        }
        _ => Ok(Ok(())),
    }
}

async fn join(c: tokio::task::JoinHandle<Result<bool>>) -> Result<()> {
    c.await.map_err(|e| Error::Internal(format!("tcp: a staging copy failed: {e}")))?.map(drop)
}

/// A READ of device memory: each half of a bounce is filled from the device while the other is
/// sent. A checksum would have to precede the bytes, so a checksummed READ of device memory is
/// refused.
async fn read_device(
    sock: &TcpStream,
    host: &dyn BackendHost,
    slice: &MemSlice,
    h: &DataHeader,
    dog: &mut Watchdog,
) -> Result<()> {
    if h.crc().is_some() {
        let e = Error::Unsupported {
            backend: crate::NAME,
            what: "a checksummed READ of device memory (the checksum precedes the bytes)".into(),
        };
        return respond(sock, Kind::ReadResp, h.id, Err(e), dog).await;
    }
    let bounce = match host.bounce().await {
        Ok(b) => b,
        Err(e) => return respond(sock, Kind::ReadResp, h.id, Err(e), dog).await,
    };
    let half = bounce.len() / 2;
    let piece = |k: u64| (k * half, half.min(h.len - k * half));
    let first = if h.len == 0 {
        Ok(true)
    } else {
        let (at, n) = piece(0);
        copy_blocking(bounce.sub(0, n)?, slice.sub(at, n)?, None).await
    };
    if let Err(e) = first {
        return respond(sock, Kind::ReadResp, h.id, Err(e), dog).await;
    }
    let hb = DataHeader::response(Kind::ReadResp, h.id, true, h.len).encode();
    // SAFETY: `hb` is a local that outlives the send.
    unsafe { io::send_parts(sock, [(hb.as_ptr() as usize, hb.len())], dog, "READ header") }.await?;
    let pieces = h.len.div_ceil(half.max(1));
    for k in 0..pieces {
        let (_, n) = piece(k);
        let part = bounce.sub((k % 2) * half, n)?;
        // The next half is filled while this one is sent.
        let next = (k + 1 < pieces).then(|| {
            let (at, m) = piece(k + 1);
            let dst = bounce.sub(((k + 1) % 2) * half, m);
            let src = slice.sub(at, m);
            tokio::spawn(async move { copy_blocking(dst?, src?, None).await })
        });
        // SAFETY: `part` is `n` bytes of the bounce's pinned host memory, filled above and not
        // written again until this send is over (the next copy fills the other half).
        unsafe { io::send_parts(sock, [(part.ptr() as usize, n as usize)], dog, "READ payload") }
            .await?;
        if let Some(c) = next {
            // The header promised the bytes: a copy that fails now ends the stream.
            join(c).await?;
        }
    }
    Ok(())
}

async fn serve_notify(
    sock: &TcpStream,
    host: &dyn BackendHost,
    h: &DataHeader,
    dog: &mut Watchdog,
) -> Result<()> {
    let body = recv_message(sock, h.len, dog, "notification").await?;
    let r = host.deliver(body);
    respond(sock, Kind::NotifyAck, h.id, r, dog).await
}

/// The `len` bytes of a notification (bounded by MAX_NOTIFY_WIRE in decode).
async fn recv_message(
    sock: &TcpStream,
    len: u64,
    dog: &mut Watchdog,
    what: &'static str,
) -> Result<Bytes> {
    let mut body = vec![0u8; len as usize];
    if !body.is_empty() && !io::recv_buf(sock, &mut body, dog, &|| true, what).await? {
        return Err(Error::PeerClosed(format!("tcp: stream ended inside a {what}")));
    }
    Ok(Bytes::from(body))
}
