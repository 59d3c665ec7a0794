//! The tensorwire side of a measurement: two engines on this host joined by the backend under test,
//! a source and a destination region of the largest size, and one session.

use crate::Result;
use std::sync::Arc;

use tensorwire_core::{
    Engine, Error, Permissions, PreparedTransfer, Region, Session, TransferOp, backend::Backend,
    backend::MemBackend,
};
use tensorwire_shm::ShmBackend;
use tensorwire_tcp::{TcpBackend, TcpConfig};

/// Backends the harness can build.
pub const BACKENDS: &[&str] = &["tcp", "shm", "mem", "ucx", "rdma", "cuda"];

/// Makes one backend instance of `name`.
pub fn make_backend(name: &str, streams: usize) -> Result<Arc<dyn Backend>> {
    match name {
        "tcp" => Ok(TcpBackend::new(TcpConfig { streams, ..TcpConfig::default() })?),
        "shm" => Ok(ShmBackend::new()?),
        "mem" => Ok(MemBackend::new()),
        // Transports from UCX's environment (UCX_TLS, ...), which the baseline inherits too.
        "ucx" => Ok(tensorwire_ucx::new_backend(tensorwire_ucx::UcxConfig::default())?),
        // Real NICs when this build has `verbs` and the host has a device, else two software
        // NICs per engine on the process's fabric (the backend's own cost: bookkeeping, and the
        // software NIC's one copy per request).
        "rdma" => rdma(),
        "cuda" => {
            Ok(tensorwire_cuda::backend(tensorwire_cuda::CudaGpu::new()?, Default::default())?)
        }
        other => Err(Error::InvalidArgument(format!(
            "unknown backend {other:?}; this harness knows {BACKENDS:?}"
        ))
        .into()),
    }
}

fn rdma() -> Result<Arc<dyn Backend>> {
    use tensorwire_rdma::{RdmaBackend, RdmaConfig};
    if tensorwire_rdma::host_has_rdma_device() {
        if let Ok(p) = tensorwire_rdma::ibverbs_provider() {
            return Ok(RdmaBackend::new(RdmaConfig::default(), p)?);
        }
    }
    use tensorwire_rdma::soft::{SoftFabric, SoftNicSpec, SoftProvider};
    // Idle DMA threads spin 50 us before sleeping, as a NIC polls its queues: the figures are
    // the backend's cost, not the software NIC's thread wake-ups.
    let spec = SoftNicSpec { spin: std::time::Duration::from_micros(50), ..SoftNicSpec::default() };
    let nics = SoftProvider::new(&SoftFabric::global(), 2, spec);
    Ok(RdmaBackend::new(RdmaConfig::default(), nics)?)
}

/// Two connected engines with `max`-byte regions on each side.
#[derive(Debug)]
pub struct EnginePair {
    /// The initiator (owns `local`).
    pub a: Engine,
    /// The peer (owns `remote`).
    pub b: Engine,
    /// Initiator memory: WRITE source, READ destination.
    pub local: Region,
    /// Peer memory, readable and writable by `a`.
    pub remote: Region,
    /// Session a -> b.
    pub session: Session,
    /// Where every op starts in `local`: bytes past the start of its page (0 unless set with
    /// [`EnginePair::at_page_offset`]).
    pub offset: u64,
}

impl EnginePair {
    /// Two engines with a GPU each (CUDA) whose regions are device memory of GPU 0 (`device`)
    /// or host memory: the engine stages device memory for backends that move host memory.
    pub async fn on_gpu(
        backend: &str,
        streams: usize,
        max: u64,
        device: bool,
    ) -> Result<EnginePair> {
        let gpu = tensorwire_cuda::CudaGpu::new()?;
        let a = Engine::builder().backend(make_backend(backend, streams)?).gpu(gpu.clone());
        let a = a.start().await?;
        let b = Engine::builder().backend(make_backend(backend, streams)?).gpu(gpu);
        let b = b.start().await?;
        let (local, remote) = if device {
            (
                a.alloc_device(0, max, Permissions::NONE).await?,
                b.alloc_device(0, max, Permissions::READ_WRITE).await?,
            )
        } else {
            (a.alloc(max, Permissions::NONE).await?, b.alloc(max, Permissions::READ_WRITE).await?)
        };
        touch(&local, 5)?;
        touch(&remote, 6)?;
        let session = a.connect(b.local_addr()).await?;
        Ok(EnginePair { a, b, local, remote, session, offset: 0 })
    }

    /// Starts both engines and touches every page of both regions.
    pub async fn new(backend: &str, streams: usize, max: u64) -> Result<EnginePair> {
        EnginePair::at_page_offset(backend, streams, max, 0).await
    }

    /// [`EnginePair::new`] with every op's initiator side `offset` bytes into a page (the remote
    /// side stays page-aligned): a READ into a buffer from `malloc`, which starts 16 bytes into
    /// its page, has the initiator at offset 16.
    pub async fn at_page_offset(
        backend: &str,
        streams: usize,
        max: u64,
        offset: u64,
    ) -> Result<EnginePair> {
        let a = Engine::builder().backend(make_backend(backend, streams)?).start().await?;
        let b = Engine::builder().backend(make_backend(backend, streams)?).start().await?;
        let local = a.alloc(max + offset, Permissions::NONE).await?;
        let remote = b.alloc(max, Permissions::READ_WRITE).await?;
        touch(&local, 5)?;
        touch(&remote, 6)?;
        let session = a.connect(b.local_addr()).await?;
        Ok(EnginePair { a, b, local, remote, session, offset })
    }

    /// One op of `size` bytes; checks that the engine used the backend under test.
    pub async fn op(&self, write: bool, size: u64, backend: &str) -> Result<()> {
        self.batch(write, size, 1, backend).await
    }

    /// One op of `size` bytes, prepared for [`post_checked`].
    pub async fn prepare(&self, write: bool, size: u64) -> Result<PreparedTransfer> {
        let remote = self.remote.remote();
        let op = match write {
            true => TransferOp::write(&self.local, self.offset, &remote, 0, size),
            false => TransferOp::read(&self.local, self.offset, &remote, 0, size),
        };
        Ok(self.session.prepare(vec![op]).await?)
    }

    /// `n` ops of `size` bytes each, at consecutive offsets, in one submit; completes when
    /// every op has (the regions must hold `n * size` bytes).
    pub async fn batch(&self, write: bool, size: u64, n: usize, backend: &str) -> Result<()> {
        let remote = self.remote.remote();
        let ops = (0..n as u64)
            .map(|i| {
                let at = i * size;
                if write {
                    TransferOp::write(&self.local, self.offset + at, &remote, at, size)
                } else {
                    TransferOp::read(&self.local, self.offset + at, &remote, at, size)
                }
            })
            .collect();
        submit_checked(&self.session, ops, backend).await
    }
}

/// Submits `ops` at once and waits for all; checks that the engine moved each with `backend`.
pub(crate) async fn submit_checked(
    session: &Session,
    ops: Vec<TransferOp>,
    backend: &str,
) -> Result<()> {
    for h in session.submit(ops).await {
        let report = h.await?;
        if report.backend != backend {
            let e = Error::protocol(format!("engine moved it with {}", report.backend));
            return Err(e.into());
        }
    }
    Ok(())
}

/// Posts `prep` once and waits for it; checks that the engine moved it with `backend`.
pub async fn post_checked(prep: &PreparedTransfer, backend: &str) -> Result<()> {
    let report = prep.post().await.await?;
    if report.backend != backend {
        let e = Error::protocol(format!("engine moved it with {}", report.backend));
        return Err(e.into());
    }
    Ok(())
}

/// Writes every page of `r` once.
pub fn touch(r: &Region, v: u8) -> Result<()> {
    let page = vec![v; 1 << 20];
    let mut at = 0;
    while at < r.len() {
        let n = (r.len() - at).min(page.len() as u64);
        r.write_bytes(at, &page[..n as usize])?;
        at += n;
    }
    Ok(())
}
