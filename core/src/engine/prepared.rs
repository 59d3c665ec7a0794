//! `PreparedTransfer`: ops checked, routed and given their connections once, then posted again
//! and again (a layer's pages every step, a latent's chunk every denoising step). An op that its
//! connection can run within the call (shm's copy into memory it holds a lease on) then costs
//! its copy and a few loads; the others take the usual path of [`Session::submit`].

use std::sync::Arc;
use std::time::Instant;

use super::session::Session;
use super::transfer::{CALL_BYTES, TransferHandle, TransferOp, TransferReport, counted};
use crate::backend::{Connection, RemoteSlice};
use crate::error::Result;

/// Ops [`Session::prepare`]d once and posted any number of times with
/// [`PreparedTransfer::post`]. Share it behind an `Arc`; posts may overlap.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use tensorwire_core::{Engine, backend::MemBackend, Permissions, TransferOp};
/// let a = Engine::builder().backend(MemBackend::new()).start().await?;
/// let b = Engine::builder().backend(MemBackend::new()).start().await?;
/// let src = a.alloc(4096, Permissions::NONE).await?;
/// let dst = b.alloc(4096, Permissions::WRITE).await?;
/// let session = a.connect(b.local_addr()).await?;
/// let step = session.prepare(vec![TransferOp::write(&src, 0, &dst.remote(), 0, 4096)]).await?;
/// for i in 0..3u8 {
///     src.write_bytes(0, &[i; 4096])?;
///     let report = step.post().await.await?;
///     assert_eq!(report.bytes, 4096);
///     assert_eq!(dst.to_vec(0, 4096)?, vec![i; 4096]);
/// }
/// # Ok::<(), tensorwire_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug)]
pub struct PreparedTransfer {
    session: Session,
    ops: Vec<TransferOp>,
    /// Per op, how it may run within [`PreparedTransfer::post`]; `None` for one that always
    /// takes the usual path (staged through a GPU bounce, or cut into several requests).
    now: Vec<Option<Now>>,
    /// Per op, the backend the engine chose for it.
    backends: Vec<&'static str>,
}

/// One op as its connection runs it within a call. Its local memory is sliced at each post:
/// a slice held here would keep the region's in-flight gate open, and its deregistration
/// waiting, for as long as the preparation lives.
#[derive(Debug)]
struct Now {
    conn: Arc<dyn Connection>,
    remote: RemoteSlice,
}

impl Session {
    /// Checks `ops` as [`Session::submit`] does (regions, bounds, a backend for each), opens
    /// their connections, and keeps the result for [`PreparedTransfer::post`]: a transfer made
    /// again and again then pays for its checks once. An op refused here fails the whole
    /// preparation with its error. The peer's own checks (key, permissions, whether its region
    /// is still registered) still run at every post.
    pub async fn prepare(&self, ops: Vec<TransferOp>) -> Result<PreparedTransfer> {
        let engine = self.engine()?;
        let peer = self.shared_descriptor();
        let mut now = Vec::with_capacity(ops.len());
        let mut backends = Vec::with_capacity(ops.len());
        for op in &ops {
            let r = self.route(&engine, &peer, op)?;
            let backend = engine.backends[r.backend].clone();
            backends.push(backend.name());
            if !r.may_run_now(&engine) {
                now.push(None);
                continue;
            }
            let c = self.connection(&engine, &backend).await?;
            now.push(Some(Now { conn: c.conn, remote: r.remote(backend.name()) }));
        }
        Ok(PreparedTransfer { session: self.clone(), ops, now, backends })
    }
}

impl PreparedTransfer {
    /// Starts every op once more. The ops that their connections can run within this call
    /// (in order, up to the first that cannot, and up to 1 MiB in all) end before it returns;
    /// the rest are submitted as [`Session::submit`] would. The handle resolves when every op has ended, to the first
    /// error or to a report of all the bytes (its backend is the ops' one, or "mixed"). An op
    /// that fails within the call ends the post: the ops after it do not start.
    pub async fn post(&self) -> TransferHandle {
        let engine = match self.session.engine() {
            Ok(e) => e,
            Err(e) => return TransferHandle::failed(e),
        };
        let start = Instant::now();
        let mut budget = CALL_BYTES;
        let mut ran = 0;
        let mut failed = None;
        for (op, now) in self.ops.iter().zip(&self.now) {
            let Some(n) = now else { break };
            let local = match op.local.slice(op.local_offset, op.len, "local") {
                Ok(l) => l,
                Err(e) => {
                    failed = Some(e); // deregistered since
                    break;
                }
            };
            match n.conn.run_now(op.dir, &local, &n.remote, &mut budget) {
                None => break,
                Some(Ok(())) => ran += 1,
                Some(Err(e)) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let elapsed = start.elapsed();
        for (op, &backend) in self.ops.iter().zip(&self.backends).take(ran) {
            counted(Some(&engine), backend, (op.dir, op.len), elapsed, &Ok(()));
        }
        let backend = self.backend();
        if let Some(e) = failed {
            let op = &self.ops[ran];
            counted(Some(&engine), self.backends[ran], (op.dir, op.len), elapsed, &Err(e.clone()));
            return TransferHandle::ended(self.backends[ran], Err(e));
        }
        let bytes: u64 = self.ops[..ran].iter().map(TransferOp::len).sum();
        if ran == self.ops.len() {
            return TransferHandle::ended(
                backend,
                Ok(TransferReport { backend, bytes, elapsed, host_staged: false }),
            );
        }
        let rest = self.session.submit(self.ops[ran..].to_vec()).await;
        TransferHandle::from_future(backend, async move {
            let mut bytes = bytes;
            for h in rest {
                bytes += h.await?.bytes;
            }
            Ok(TransferReport { backend, bytes, elapsed: start.elapsed(), host_staged: false })
        })
    }

    /// The ops, as given to [`Session::prepare`].
    pub fn ops(&self) -> &[TransferOp] {
        &self.ops
    }

    /// The backend of every op, or "mixed" ("none" for no ops).
    fn backend(&self) -> &'static str {
        match self.backends.split_first() {
            None => "none",
            Some((b, rest)) if rest.iter().all(|r| r == b) => b,
            Some(_) => "mixed",
        }
    }
}
