//! Secure by default, the engine's control endpoint: a reachable address needs a cluster secret
//! or an explicit `insecure` opt-out, and a client without the secret learns nothing (no
//! descriptor, so no region key), whatever it claims.

use tensorwire_core::ClusterSecret;
use tensorwire_core::{Engine, EngineConfig, Error, Permissions, backend::MemBackend};
use tensorwire_proto::wire::frame::CONTROL;
use tensorwire_testkit::intruder::{Claim, assert_refused, frames_received};

/// The control channel's descriptor frame kind.
const HELLO: u8 = 1;

async fn engine(config: EngineConfig) -> Result<Engine, Error> {
    Engine::builder().backend(MemBackend::new()).config(config).start().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reachable_endpoint_needs_a_secret_or_insecure() {
    let open = EngineConfig { listen: "0.0.0.0:0".parse().unwrap(), ..EngineConfig::default() };
    let e = engine(open.clone()).await.unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("cluster secret")), "{e}");
    let insecure = engine(EngineConfig { insecure: true, ..open.clone() }).await.unwrap();
    insecure.shutdown().await;
    let secret = Some(ClusterSecret::new("0123456789abcdef0123456789abcdef"));
    let secured = engine(EngineConfig { cluster_secret: secret, ..open }).await.unwrap();
    secured.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_the_secret_learns_no_region_key() {
    let secret = Some(ClusterSecret::new("0123456789abcdef0123456789abcdef"));
    let e =
        engine(EngineConfig { cluster_secret: secret, ..EngineConfig::default() }).await.unwrap();
    let shown = e.alloc(4096, Permissions::READ_WRITE).await.unwrap();
    let key = shown.remote().key.to_bits().to_le_bytes();
    let other = engine(EngineConfig::default()).await.unwrap();
    let hello = other.descriptor().encode();
    for claim in [Claim::WrongProof, Claim::NoProof] {
        let frames = frames_received(e.local_addr(), &CONTROL, claim, (HELLO, &hello)).await;
        assert_refused("engine control endpoint", &frames, Some(&key));
    }
    e.shutdown().await;
    other.shutdown().await;
}

/// The probe itself: proving the user's loopback secret (what a process of the same user does)
/// it gets the descriptor of an engine without a cluster secret, keys included, so the tests
/// here would see a leak; without that proof (what a process of another user on the host has)
/// it gets nothing from the same engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_sees_what_an_open_engine_shows_and_only_to_its_user() {
    let e = engine(EngineConfig::default()).await.unwrap();
    let shown = e.alloc(4096, Permissions::READ_WRITE).await.unwrap();
    let key = shown.remote().key.to_bits().to_le_bytes();
    let hello = engine(EngineConfig::default()).await.unwrap().descriptor().encode();
    let mine = Claim::Proves(tensorwire_proto::loopback_secret::loopback_secret().unwrap());
    let frames = frames_received(e.local_addr(), &CONTROL, mine, (HELLO, &hello)).await;
    let (kind, descriptor) = &frames[1];
    assert_eq!(*kind, HELLO);
    assert!(descriptor.windows(key.len()).any(|w| w == key), "the descriptor carries the key");
    let another_user = Claim::Proves(ClusterSecret::new("another user's loopback secret"));
    for claim in [Claim::WrongProof, Claim::NoProof, another_user] {
        let frames = frames_received(e.local_addr(), &CONTROL, claim, (HELLO, &hello)).await;
        assert_refused("engine control endpoint without a secret", &frames, Some(&key));
    }
    e.shutdown().await;
}
