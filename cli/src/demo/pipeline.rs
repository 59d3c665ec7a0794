//! What the demo's pipelines are made of, shared by the in-process run (`demo`), the worker
//! processes (`procs`), `soak` and the shift scenario: the pools' sizes, the payloads' shapes and
//! bytes, the store node and a loopback tcp engine.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tensorwire_core::ClusterSecret;
use tensorwire_core::{DType, Engine, EngineConfig, TensorMeta};
use tensorwire_store::{EmbeddedStore, StoreConfig, StoreNode};
use tensorwire_tcp::{TcpBackend, TcpConfig};

use tensorwire_sim::profiles::Model;

/// Microseconds since the Unix epoch (the clock worker processes stamp their lines with).
pub(crate) fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Workers per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    /// Encode workers.
    pub encode: u32,
    /// Denoise workers.
    pub denoise: u32,
    /// Decode workers.
    pub decode: u32,
}

/// Parses "E:N:M".
pub(crate) fn parse_split(s: &str, gpus: u32) -> anyhow::Result<Split> {
    let v: Vec<u32> = s
        .split(':')
        .map(|x| x.trim().parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("--split {s:?}: expected E:N:M, e.g. 1:6:1"))?;
    let [e, n, m] = v[..] else {
        return Err(anyhow::anyhow!("--split {s:?}: expected three numbers E:N:M"));
    };
    if e == 0 || n == 0 || m == 0 || e + n + m != gpus {
        return Err(anyhow::anyhow!(
            "--split {s:?}: each pool needs a worker and the pools must add up to --gpus {gpus}"
        ));
    }
    Ok(Split { encode: e, denoise: n, decode: m })
}

/// Workers proportional to the mix's total stage times (LightX2V's rule), at least one each.
pub(crate) fn auto_split(mix: &[&Model], gpus: u32) -> anyhow::Result<Split> {
    if gpus < 3 {
        return Err(anyhow::anyhow!(
            "--gpus {gpus}: a disaggregated pipeline needs at least 3 (one per stage)"
        ));
    }
    let (e, n, m) = mix.iter().fold((0.0, 0.0, 0.0), |(e, n, m), x| {
        (e + x.encode_ms, n + x.denoise_ms(), m + x.decode_ms)
    });
    let total = e + n + m;
    let share = |t: f64| ((t / total * f64::from(gpus)).round() as u32).max(1);
    let (mut se, mut sm) = (share(e), share(m));
    while se + sm + 1 > gpus {
        if se >= sm { se -= 1 } else { sm -= 1 }
    }
    Ok(Split { encode: se.max(1), denoise: gpus - se.max(1) - sm.max(1), decode: sm.max(1) })
}

/// Bytes of a payload of `len` for `seed` (the receiver checks every byte).
pub(crate) fn fill(len: u64, seed: u64) -> Vec<u8> {
    (0..len as usize)
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9).wrapping_add(seed) as u8)
        .collect()
}

pub(crate) fn embed_meta(m: &Model) -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &[m.embed_bytes / 2])
}

pub(crate) fn latent_meta(m: &Model) -> TensorMeta {
    TensorMeta::contiguous(DType::BF16, &m.latent_shape)
}

/// The demo's store node: an engine on loopback with a 512 MiB shared pool served over the RPC.
pub(crate) async fn store_node(
    capacity: u64,
) -> anyhow::Result<(Engine, Arc<EmbeddedStore>, StoreNode)> {
    let engine = tcp_engine(None).await?;
    let cfg = StoreConfig { capacity, shared: true, ..StoreConfig::default() };
    let store = EmbeddedStore::new(&engine, cfg).await?;
    let listen = "127.0.0.1:0".parse().map_err(|_| anyhow::Error::msg("address"))?;
    let node = StoreNode::serve(store.clone(), listen).await?;
    Ok((engine, store, node))
}

/// The demo's store node pool.
pub(crate) const STORE_BYTES: u64 = 512 << 20;

/// An engine on loopback over tcp, with `secret` as its cluster secret.
pub(crate) async fn tcp_engine(cluster_secret: Option<ClusterSecret>) -> anyhow::Result<Engine> {
    let tcp = TcpBackend::new(TcpConfig::default())?;
    let config = EngineConfig { cluster_secret, ..EngineConfig::default() };
    Engine::builder().backend(tcp).config(config).start().await.map_err(anyhow::Error::from)
}
