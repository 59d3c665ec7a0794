//! The tensorwire conformance suite, written once and run by every backend.
//!
//! Each test is a public async function taking a [`PairFactory`] (two engines built from the backend
//! under test, plus its [`Capabilities`]); it exercises the backend only through the engine, which
//! uses only the `Backend` trait, so a third-party backend runs the same suite. A backend's
//! `tests/it/conformance.rs` is one line:
//!
//! ```ignore
//! tensorwire_conformance::conformance_tests!(tensorwire_conformance::BackendPair::new(|| my_backend()));
//! ```
//!
//! which expands to one `#[tokio::test]` per suite function. [`run_all`] runs the whole list in one go.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::{
    Engine, EngineConfig, MemoryKind, Permissions, Region, Result, Session, backend::Backend,
    backend::Capabilities, gpu::Gpu,
};

pub mod harness;
pub mod multiprocess;
pub mod tests;

#[doc(hidden)]
pub mod __private {
    pub use tokio;
}

/// Two engines that can reach each other: `a` initiates, `b` is the peer.
#[derive(Debug)]
pub struct Pair {
    /// The initiating engine.
    pub a: Engine,
    /// The peer engine.
    pub b: Engine,
}

/// Builds engine pairs for the backend under test.
#[async_trait]
pub trait PairFactory: Send + Sync {
    /// The backend's capabilities (tests adapt to them explicitly, never by silently skipping).
    fn capabilities(&self) -> Capabilities;
    /// Two fresh engines configured with `config`.
    async fn pair(&self, config: EngineConfig) -> Pair;
    /// The memory the suite's regions are made of (host memory unless the factory says).
    fn memory(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

/// A region of `len` bytes of the factory's memory kind on engine `e` (what every suite test
/// allocates its data regions with).
pub async fn alloc(
    f: &dyn PairFactory,
    e: &Engine,
    len: u64,
    perms: Permissions,
) -> Result<Region> {
    match f.memory() {
        MemoryKind::Host => e.alloc(len, perms).await,
        MemoryKind::HostPinned => e.alloc_pinned(len, perms).await,
        MemoryKind::Device { ordinal } => e.alloc_device(ordinal, len, perms).await,
    }
}

/// A [`PairFactory`] whose engines have a GPU (made by `gpu`) and whose regions are device
/// memory of GPU 0: the suite over device memory.
pub struct DevicePair<F, G> {
    make: F,
    gpu: G,
}

impl<F, G, D> DevicePair<F, G>
where
    F: Fn() -> Arc<dyn Backend> + Send + Sync,
    G: Fn() -> Arc<D> + Send + Sync,
    D: Gpu,
{
    /// Engines from `make`'s backends, each with a GPU from `gpu`.
    pub fn new(make: F, gpu: G) -> Self {
        Self { make, gpu }
    }
}

#[async_trait]
impl<F, G, D> PairFactory for DevicePair<F, G>
where
    F: Fn() -> Arc<dyn Backend> + Send + Sync,
    G: Fn() -> Arc<D> + Send + Sync,
    D: Gpu,
{
    fn capabilities(&self) -> Capabilities {
        (self.make)().capabilities()
    }

    async fn pair(&self, config: EngineConfig) -> Pair {
        let engine = |c: EngineConfig| {
            Engine::builder().backend((self.make)()).gpu((self.gpu)()).config(c).start()
        };
        let a = engine(config.clone()).await;
        let b = engine(config).await;
        Pair { a: a.expect("start engine a"), b: b.expect("start engine b") }
    }

    fn memory(&self) -> MemoryKind {
        MemoryKind::Device { ordinal: 0 }
    }
}

/// A [`PairFactory`] from a function that makes one backend instance per engine.
pub struct BackendPair<F> {
    make: F,
}

impl<F> BackendPair<F>
where
    F: Fn() -> Arc<dyn Backend> + Send + Sync,
{
    /// Wraps `make`.
    pub fn new(make: F) -> Self {
        Self { make }
    }
}

#[async_trait]
impl<F> PairFactory for BackendPair<F>
where
    F: Fn() -> Arc<dyn Backend> + Send + Sync,
{
    fn capabilities(&self) -> Capabilities {
        (self.make)().capabilities()
    }

    async fn pair(&self, config: EngineConfig) -> Pair {
        let a = Engine::builder().backend((self.make)()).config(config.clone()).start().await;
        let b = Engine::builder().backend((self.make)()).config(config).start().await;
        Pair { a: a.expect("start engine a"), b: b.expect("start engine b") }
    }
}

/// Bound on any single step of a test: a backend that hangs fails the test instead of hanging it.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// Awaits `fut`, failing the test if it takes longer than [`STEP_TIMEOUT`].
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(STEP_TIMEOUT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {STEP_TIMEOUT:?} (hang)"),
    }
}

/// A pair with the default configuration and a session from `a` to `b`.
pub async fn connected(f: &dyn PairFactory) -> (Pair, Session) {
    connected_with(f, EngineConfig::default()).await
}

/// A pair with `config` and a session from `a` to `b`.
pub async fn connected_with(f: &dyn PairFactory, config: EngineConfig) -> (Pair, Session) {
    let pair = f.pair(config).await;
    let s = bounded("connect", pair.a.connect(pair.b.local_addr())).await.expect("connect a -> b");
    (pair, s)
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed).collect()
}

/// Invokes `$m!($factory, name)` for every suite test, in run order.
#[doc(hidden)]
#[macro_export]
macro_rules! __each_test {
    ($mode:tt, $f:expr) => {
        $crate::__one_test!($mode, $f, write_read_zero_bytes);
        $crate::__one_test!($mode, $f, write_read_one_byte);
        $crate::__one_test!($mode, $f, write_read_4k);
        $crate::__one_test!($mode, $f, write_read_unaligned);
        $crate::__one_test!($mode, $f, write_read_64mib);
        $crate::__one_test!($mode, $f, read_serves_peer_data);
        $crate::__one_test!($mode, $f, batch_of_1000_small);
        $crate::__one_test!($mode, $f, concurrent_batches);
        $crate::__one_test!($mode, $f, per_request_completion);
        $crate::__one_test!($mode, $f, telemetry_names_backend_and_counts_bytes);
        $crate::__one_test!($mode, $f, chunked_contiguous);
        $crate::__one_test!($mode, $f, chunked_strided);
        $crate::__one_test!($mode, $f, chunked_progressive_latent);
        $crate::__one_test!($mode, $f, chunk_sender_dropped_aborts);
        $crate::__one_test!($mode, $f, chunk_stream_times_out);
        $crate::__one_test!($mode, $f, chunk_bad_marks);
        $crate::__one_test!($mode, $f, notification_after_data);
        $crate::__one_test!($mode, $f, notifications_in_order);
        $crate::__one_test!($mode, $f, notification_bounds);
        $crate::__one_test!($mode, $f, notification_handler_verdicts);
        $crate::__one_test!($mode, $f, notice_with_ops);
        $crate::__one_test!($mode, $f, prepared_posts_again_and_again);
        $crate::__one_test!($mode, $f, prepared_meets_the_peers_checks);
        $crate::__one_test!($mode, $f, reject_out_of_bounds);
        $crate::__one_test!($mode, $f, reject_wrong_key);
        $crate::__one_test!($mode, $f, reject_unknown_region);
        $crate::__one_test!($mode, $f, reject_deregistered_region);
        $crate::__one_test!($mode, $f, reject_permissions);
        $crate::__one_test!($mode, $f, reject_foreign_regions);
        $crate::__one_test!($mode, $f, reverse_session);
        $crate::__one_test!($mode, $f, peer_goes_away_mid_transfer);
        $crate::__one_test!($mode, $f, deregister_with_transfers_in_flight);
        $crate::__one_test!($mode, $f, deregister_after_repeated_ops);
        $crate::__one_test!($mode, $f, cancellation_is_safe);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __one_test {
    (test, $f:expr, $name:ident) => {
        #[$crate::__private::tokio::test(
            flavor = "multi_thread",
            worker_threads = 2,
            crate = "tensorwire_conformance::__private::tokio"
        )]
        async fn $name() {
            $crate::tests::$name(&$f).await
        }
    };
    (run, $f:expr, $name:ident) => {
        $crate::tests::$name($f).await;
    };
    (name, $f:expr, $name:ident) => {
        $f.push(stringify!($name));
    };
}

/// Expands to one `#[tokio::test]` per suite function, each run against `$factory`.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr) => {
        $crate::__each_test!(test, $factory);
    };
}

/// Runs the whole suite against `f`, in order; panics on the first failure (the panic names it).
pub async fn run_all(f: &dyn PairFactory) {
    crate::__each_test!(run, f);
}

/// Names of every suite test, in run order.
#[allow(clippy::vec_init_then_push)]
pub fn test_names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = Vec::new();
    crate::__each_test!(name, v);
    v
}
