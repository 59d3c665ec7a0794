//! The serving side of one peer connection. A Begin is checked through the engine's
//! `BackendHost::resolve` (region, key, permission, bounds, deregistration) and the resolved slice
//! is held until the peer's End, so deregistration waits for the peer's copy exactly as it waits
//! for local ones. The region's export (for shm its memfd, read-only unless peers may write) goes
//! with the first grant.
//! A Begin that asks for a lease holds the whole region (checked the same way, for the op's
//! access) until the peer's `Released`, which it sends after the region's `Forget` once its
//! copies are over: deregistration waits for it as it waits for a held op. When the peer goes
//! away, everything it held is released. The first frame to the peer is its live page (see
//! [`crate::live`]), which the backend's shutdown marks closed ([`Served`] holds the pages).

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};

use bytes::Bytes;
use tensorwire_core::backend::kit::encode_error;
use tensorwire_core::{Error, MemSlice, RegionId, Result, backend::Access, backend::BackendHost};

use crate::Table;
use crate::live::LivePage;
use crate::uds::{FrameReader, FrameWriter};
use crate::wire::{ACCESS_WRITE, HAS_FD, Header, Kind, LEASE, WANT_SHARE, WRITABLE};

/// Most ops one peer may hold open at once.
const MAX_HELD: usize = 1 << 16;

/// Test hook: every server in the process sends the region's export with every grant, asked for
/// or not (a peer that misbehaves), so the client's refusal can be tested.
#[cfg(test)]
pub(crate) static SHARE_UNASKED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

fn share_wanted(h: &Header) -> bool {
    #[cfg(test)]
    if SHARE_UNASKED.load(std::sync::atomic::Ordering::SeqCst) {
        return true;
    }
    h.flags & WANT_SHARE != 0
}

/// One accepted peer connection.
#[derive(Debug)]
pub(crate) struct ServerConn {
    pub(crate) writer: FrameWriter,
    /// Regions whose export this peer received (it gets a Forget when they go).
    pub(crate) mapped: Mutex<HashSet<RegionId>>,
}

impl ServerConn {
    /// Tells the peer to drop its mapping of `region`, if it has one.
    pub(crate) async fn forget(&self, region: RegionId) {
        if self.mapped.lock().remove(&region) {
            let mut h = Header::new(Kind::Forget, 0);
            h.region = region;
            let _ = self.writer.send(&h, &[], None).await;
        }
    }
}

/// The connections a backend serves, each with its live page. The pages are held here, not by
/// the connections, so a shutdown marks every one, even that of a connection whose aborted
/// task another thread is dropping right then (it may have left a list of weak references
/// already, and its stream not be closed yet).
#[derive(Debug, Default)]
pub(crate) struct Served(Mutex<Vec<(Weak<ServerConn>, LivePage)>>);

impl Served {
    /// Adds `conn` with its `page`; the entries of connections gone since leave, their pages
    /// marked closed. `closed`, read under the list's lock, says a shutdown began: the page is
    /// marked now, as that shutdown may have emptied the list already.
    pub(crate) fn push(&self, conn: &Arc<ServerConn>, page: LivePage, closed: impl Fn() -> bool) {
        let mut v = self.0.lock();
        v.retain(|(c, page)| {
            let served = c.strong_count() > 0;
            if !served {
                page.close();
            }
            served
        });
        if closed() {
            page.close();
        }
        v.push((Arc::downgrade(conn), page));
    }

    /// The connections still served.
    pub(crate) fn live(&self) -> Vec<Arc<ServerConn>> {
        self.0.lock().iter().filter_map(|(c, _)| c.upgrade()).collect()
    }

    /// Shutdown: marks every page closed (a peer's op that copies in `submit` reads it first,
    /// so none lands after the shutdown returned), then hangs up every stream (peers' readers
    /// see the end now, not once the aborted serving tasks drop their streams).
    pub(crate) fn close(&self) {
        let all = std::mem::take(&mut *self.0.lock());
        for (_, page) in &all {
            page.close();
        }
        for conn in all.iter().filter_map(|(c, _)| c.upgrade()) {
            conn.writer.hang_up();
        }
    }
}

async fn reply(conn: &ServerConn, kind: Kind, req: u64, r: Result<()>) -> Result<()> {
    let mut h = Header::new(kind, req);
    match r {
        Ok(()) => conn.writer.send(&h, &[], None).await,
        Err(e) => {
            let body = encode_error(&e);
            h.ok = false;
            h.len = body.len() as u64;
            conn.writer.send(&h, &body, None).await
        }
    }
}

/// Serves `conn` until the peer closes it or breaks the protocol; first passes the peer `live`,
/// the descriptor of `conn`'s live page.
pub(crate) async fn serve(
    conn: Arc<ServerConn>,
    mut reader: FrameReader,
    host: Arc<dyn BackendHost>,
    table: Arc<Table>,
    live: OwnedFd,
) {
    let mut held = Held::default();
    let mut h = Header::new(Kind::Live, 0);
    h.flags = HAS_FD;
    let sent = conn.writer.send(&h, &[], Some(live.as_raw_fd())).await;
    drop(live); // the peer has its own now
    let served = match sent {
        Ok(()) => serve_inner(&conn, &mut reader, &*host, &table, &mut held).await,
        Err(e) => Err(e),
    };
    if let Err(e) = served {
        if !matches!(e, Error::PeerClosed(_)) {
            tracing::warn!(error = %e, "shm: peer connection closed");
        }
    }
    // `held` drops here: a peer that vanished mid-copy no longer blocks deregistration.
}

/// What one peer holds: ops until their End, leases (region, write access) until Released.
#[derive(Debug, Default)]
struct Held {
    ops: HashMap<u64, MemSlice>,
    leases: HashMap<(RegionId, bool), MemSlice>,
}

async fn serve_inner(
    conn: &ServerConn,
    reader: &mut FrameReader,
    host: &dyn BackendHost,
    table: &Table,
    held: &mut Held,
) -> Result<()> {
    while let Some(f) = reader.next().await? {
        let h = f.h;
        if f.fd.is_some() {
            return Err(Error::protocol("shm: the client sent a descriptor"));
        }
        match h.kind {
            Kind::Begin => {
                let access = if h.flags & ACCESS_WRITE != 0 { Access::Write } else { Access::Read };
                let slice = match host.resolve(h.range(), access) {
                    Ok(s) => s,
                    Err(e) => {
                        reply(conn, Kind::Granted, h.req, Err(e)).await?;
                        continue;
                    }
                };
                let Some(share) = table.get(h.region) else {
                    let e = Error::Unsupported {
                        backend: table.backend,
                        what: format!("region {} is not shareable (caller memory)", h.region.0),
                    };
                    reply(conn, Kind::Granted, h.req, Err(e)).await?;
                    continue;
                };
                if held.ops.len() >= MAX_HELD || held.ops.contains_key(&h.req) {
                    return Err(Error::protocol("shm: too many open ops, or a reused request id"));
                }
                let mut g = Header::new(Kind::Granted, h.req);
                g.region = h.region;
                g.len = share.len;
                // A lease: the whole region, for this access, until the peer releases it.
                let write = access == Access::Write;
                let whole = tensorwire_core::backend::RemoteRange {
                    offset: 0,
                    len: share.len,
                    ..h.range()
                };
                let lease = (h.flags & LEASE != 0 && !held.leases.contains_key(&(h.region, write)))
                    .then(|| host.resolve(whole, access).ok())
                    .flatten();
                match lease {
                    Some(whole) => {
                        held.leases.insert((h.region, write), whole);
                        g.flags |= LEASE;
                    }
                    None => {
                        held.ops.insert(h.req, slice);
                    }
                }
                let (mut fd, mut body) = (None, &[][..]);
                if share_wanted(&h) {
                    g.flags |= if share.writable { WRITABLE } else { 0 };
                    if let Some(d) = &share.fd {
                        g.flags |= HAS_FD;
                        fd = Some(d.as_raw_fd());
                    }
                    body = &share.share;
                    g.share = body.len() as u16; // at most MAX_SHARE_BYTES (checked at export)
                    conn.mapped.lock().insert(h.region);
                }
                conn.writer.send(&g, body, fd).await?;
                // Deregistered meanwhile (its gate closed after the resolve): the Forget that
                // deregistration sent may have come before this lease existed. Say it again,
                // so the peer releases the lease and the deregistration can finish.
                if g.flags & LEASE != 0 && table.get(h.region).is_none() {
                    let mut f = Header::new(Kind::Forget, 0);
                    f.region = h.region;
                    conn.writer.send(&f, &[], None).await?;
                }
            }
            Kind::End => {
                held.ops.remove(&h.req);
            }
            Kind::Released => {
                held.leases.remove(&(h.region, h.flags & ACCESS_WRITE != 0));
            }
            Kind::Notify => {
                let r = host.deliver(Bytes::from(f.body));
                reply(conn, Kind::NotifyAck, h.req, r).await?;
            }
            k => return Err(Error::protocol(format!("shm: the client sent a {k:?}"))),
        }
    }
    Ok(())
}
