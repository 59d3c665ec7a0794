//! A peer engine in a child process, for media whose baseline runs as two processes
//! (`ucx_perftest`), whose path exists only between processes (CUDA IPC), or that deployments
//! run between processes (shm): the harness re-runs its own binary, with its arguments and
//! [`PEER_ENV`] set; the child starts an engine with the backend under test,
//! registers one readable and writable region (device memory for cuda), prints
//! `READY <control addr> <region id> <raw addr>` and serves until its stdin closes. For tcp the
//! child also serves the raw socket baseline ([`RawTcp::serve_at`]) at `<raw addr>` (`-`
//! otherwise), so the baseline crosses processes as the engine does.

use crate::Result;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use tensorwire_core::{
    Engine, Error, Permissions, PreparedTransfer, Region, RegionId, RemoteRegion, Session,
    TransferOp,
};

use crate::raw_tcp::RawTcp;
use crate::transfer::{make_backend, submit_checked, touch};

/// Environment variable that turns the harness binary into the peer: `<backend>:<bytes>`.
pub const PEER_ENV: &str = "TENSORWIRE_BENCH_PEER";

#[cfg(feature = "ucx")]
type Memory = tensorwire_ucx::UcxMemory;
#[cfg(not(feature = "ucx"))]
type Memory = ();

/// An engine with one region of `len` bytes. With ucx the memory is allocated through UCX, as
/// ucx_perftest allocates its buffers (one-copy put/get over UCX's shared-memory transports);
/// the returned memory must outlive the region.
async fn engine_with_region(
    backend: &str,
    len: u64,
    perms: Permissions,
    streams: usize,
) -> Result<(Engine, Region, Option<Memory>)> {
    #[cfg(feature = "ucx")]
    if backend == "ucx" {
        let ucx = tensorwire_ucx::UcxBackend::with_config(tensorwire_ucx::UcxConfig::default())?;
        let e = Engine::builder().backend(ucx.clone()).start().await?;
        let memory = ucx.allocate(len).await?;
        // SAFETY: `memory` is `len` bytes of host memory that the caller keeps alive until the
        // region is dropped (ChildPair drops `local` before `_memory`; the child holds both to
        // the end).
        let region = unsafe {
            e.register_raw(memory.as_ptr(), len, tensorwire_core::MemoryKind::Host, perms).await?
        };
        return Ok((e, region, Some(memory)));
    }
    if backend == "cuda" {
        // Device memory of GPU 0 on both sides, each engine its own process: the CUDA IPC path
        // (a handle opened by the other process), as two serving processes of one host use it.
        let gpu = tensorwire_cuda::CudaGpu::new()?;
        let cuda = tensorwire_cuda::backend(gpu.clone(), Default::default())?;
        let e = Engine::builder().backend(cuda).gpu(gpu).start().await?;
        let region = e.alloc_device(0, len, perms).await?;
        return Ok((e, region, None));
    }
    let e = Engine::builder().backend(make_backend(backend, streams)?).start().await?;
    let region = e.alloc(len, perms).await?;
    Ok((e, region, None))
}

/// In the child: serves as the peer and returns true; false when [`PEER_ENV`] is not set.
pub async fn serve_if_asked() -> Result<bool> {
    let Ok(spec) = std::env::var(PEER_ENV) else { return Ok(false) };
    let (backend, len) = spec
        .split_once(':')
        .and_then(|(b, n)| Some((b.to_string(), n.parse::<u64>().ok()?)))
        .ok_or_else(|| Error::InvalidArgument(format!("{PEER_ENV}={spec}")))?;
    let (e, region, _memory) =
        engine_with_region(&backend, len, Permissions::READ_WRITE, 1).await?;
    touch(&region, 6)?;
    let mut raw = None;
    let mut raw_addr = "-".to_string();
    if backend == "tcp" {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        raw_addr = l.local_addr()?.to_string();
        raw = Some(tokio::spawn(RawTcp::serve_at(l, len)));
    }
    println!("READY {} {} {raw_addr}", e.local_addr(), region.id().0);
    // Serve until the parent closes our stdin (or dies).
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
    })
    .await
    .map_err(|e| Error::protocol(e.to_string()))?;
    raw.iter().for_each(tokio::task::JoinHandle::abort);
    e.shutdown().await;
    Ok(true)
}

/// An engine here, its peer in a child process, one session, a local and a remote region.
#[derive(Debug)]
pub struct ChildPair {
    /// The local engine.
    pub a: Engine,
    /// Local memory: WRITE source, READ destination (taken out only on drop).
    local: Option<Region>,
    /// The child's region.
    pub remote: RemoteRegion,
    /// Session to the child.
    pub session: Session,
    /// Where the child serves the raw socket baseline (tcp).
    pub raw: Option<SocketAddr>,
    child: Child,
    /// Memory behind `local` when the backend allocated it; dropped after `local`.
    _memory: Option<Memory>,
}

impl Drop for ChildPair {
    fn drop(&mut self) {
        drop(self.local.take());
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ChildPair {
    /// Spawns the child peer and connects to it (`streams`: the local backend's, tcp).
    pub async fn new(backend: &str, max: u64, streams: usize) -> Result<ChildPair> {
        // This binary with this run's arguments (a binary that parses them before it asks
        // `serve_if_asked`, as `tensorwire bench` does, parses them again).
        let mut child = Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env(PEER_ENV, format!("{backend}:{max}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| Error::protocol("child stdout"))?;
        let ready = tokio::task::spawn_blocking(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(std::result::Result::ok)
                .find_map(|l| l.strip_prefix("READY ").map(str::to_string))
        })
        .await
        .map_err(|e| Error::protocol(e.to_string()))?;
        let Some(ready) = ready else {
            let _ = child.kill();
            return Err(Error::protocol("the peer process never became ready").into());
        };
        let mut f = ready.split_whitespace();
        let addr: SocketAddr = f
            .next()
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| Error::protocol(format!("peer said {ready:?}")))?;
        let id: u64 = f
            .next()
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| Error::protocol(format!("peer said {ready:?}")))?;
        let raw = f.next().and_then(|a| a.parse().ok());
        let (a, local, memory) =
            engine_with_region(backend, max, Permissions::NONE, streams).await?;
        touch(&local, 5)?;
        let session = a.connect(addr).await?;
        let remote = session.remote_region(RegionId(id))?;
        Ok(ChildPair { a, local: Some(local), remote, session, raw, child, _memory: memory })
    }

    /// Checks the bytes of one round trip of `size` bytes: a pattern written to the peer and read
    /// back into local memory cleared in between.
    pub async fn verify(&self, size: u64, backend: &str) -> Result<()> {
        let local = self.local.as_ref().ok_or_else(|| Error::protocol("pair dropped"))?;
        let n = usize::try_from(size).map_err(|_| Error::protocol("size"))?;
        let want: Vec<u8> = (0..n).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8).collect();
        local.write_bytes(0, &want)?;
        self.op(true, size, backend).await?;
        local.write_bytes(0, &vec![0; n])?;
        self.op(false, size, backend).await?;
        if local.to_vec(0, size)? != want {
            return Err(
                Error::protocol(format!("{backend}: a {size}-byte round trip differs")).into()
            );
        }
        Ok(())
    }

    /// One op of `size` bytes; checks that the engine used `backend`.
    pub async fn op(&self, write: bool, size: u64, backend: &str) -> Result<()> {
        self.ops(write, size, 1, backend).await
    }

    /// One op of `size` bytes, prepared for [`crate::transfer::post_checked`].
    pub async fn prepare(&self, write: bool, size: u64) -> Result<PreparedTransfer> {
        let local = self.local.as_ref().ok_or_else(|| Error::protocol("pair dropped"))?;
        let op = match write {
            true => TransferOp::write(local, 0, &self.remote, 0, size),
            false => TransferOp::read(local, 0, &self.remote, 0, size),
        };
        Ok(self.session.prepare(vec![op]).await?)
    }

    /// `n` ops of `size` bytes (the same ranges) in one submit, each completing on its own;
    /// waits for all and checks that the engine used `backend`.
    pub async fn ops(&self, write: bool, size: u64, n: usize, backend: &str) -> Result<()> {
        let local = self.local.as_ref().ok_or_else(|| Error::protocol("pair dropped"))?;
        let op = || match write {
            true => TransferOp::write(local, 0, &self.remote, 0, size),
            false => TransferOp::read(local, 0, &self.remote, 0, size),
        };
        submit_checked(&self.session, (0..n).map(|_| op()).collect(), backend).await
    }
}
