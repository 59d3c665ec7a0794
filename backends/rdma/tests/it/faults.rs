//! The RDMA backend over software NICs under faults: striping over NICs, affinity, failover to
//! another rail and its recovery, a vanished NIC, fallback to tcp when no rail is left, refused
//! accesses never retried, large regions, cancellation on a slow NIC, and hostile input on the
//! control channel.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_conformance::{bounded, pattern};
use tensorwire_core::{
    Engine, EngineConfig, Error, Permissions, RemoteRegion, TransferOp, backend::Backend,
};
use tensorwire_rdma::soft::{SoftFabric, SoftNic, SoftNicSpec, SoftProvider};
use tensorwire_rdma::verbs::WcStatus;
use tensorwire_rdma::{DataPath, RdmaBackend, RdmaConfig};
use tensorwire_tcp::{TcpBackend, TcpConfig};

struct Side {
    engine: Engine,
    nics: Arc<SoftProvider>,
}

impl Side {
    fn nic(&self, i: usize) -> &SoftNic {
        &self.nics.nics()[i]
    }

    fn stat(&self, name: &str) -> u64 {
        let all = self.engine.backend_stats();
        let rdma = all.iter().find(|(b, _)| *b == "rdma").expect("rdma stats");
        rdma.1.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v)
    }
}

async fn side(fabric: &SoftFabric, specs: Vec<SoftNicSpec>, cfg: RdmaConfig, tcp: bool) -> Side {
    let nics = SoftProvider::with(fabric, specs);
    let rdma = RdmaBackend::new(cfg, nics.clone()).unwrap();
    let mut b = Engine::builder().backend(rdma as Arc<dyn Backend>);
    if tcp {
        b = b.backend(TcpBackend::new(TcpConfig::default()).unwrap());
    }
    let config =
        EngineConfig { transfer_timeout: Duration::from_secs(20), ..EngineConfig::default() };
    Side { engine: b.config(config).start().await.unwrap(), nics }
}

fn named(name: &str, numa: Option<u32>) -> SoftNicSpec {
    SoftNicSpec { name: Some(name.into()), numa_node: numa, ..SoftNicSpec::default() }
}

async fn pair(cfg: RdmaConfig, tcp: bool) -> (Side, Side) {
    let fabric = SoftFabric::new();
    let specs = |p: &str| vec![named(&format!("{p}0"), None), named(&format!("{p}1"), None)];
    let a = side(&fabric, specs("a"), cfg.clone(), tcp).await;
    let b = side(&fabric, specs("b"), cfg, tcp).await;
    (a, b)
}

async fn write_and_check(
    a: &Side,
    b: &Side,
    len: u64,
    seed: u8,
) -> tensorwire_core::TransferReport {
    let src = a.engine.alloc(len, Permissions::NONE).await.unwrap();
    let data = pattern(len as usize, seed);
    src.write_bytes(0, &data).unwrap();
    let dst = b.engine.alloc(len, Permissions::WRITE).await.unwrap();
    let s = bounded("connect", a.engine.connect(b.engine.local_addr())).await.unwrap();
    let r = bounded("write", s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, len)))
        .await
        .unwrap();
    assert!(dst.to_vec(0, len).unwrap() == data, "bytes differ");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_ops_are_striped_over_every_nic() {
    let (a, b) = pair(RdmaConfig::default(), false).await;
    let r = write_and_check(&a, &b, 64 << 20, 1).await;
    assert_eq!(r.backend, "rdma");
    let (n0, n1) = (a.stat("a0.bytes"), a.stat("a1.bytes"));
    assert_eq!(n0 + n1, 64 << 20, "every byte counted once");
    assert!(n0 >= 16 << 20 && n1 >= 16 << 20, "both NICs carry a share: {n0} / {n1}");
    assert_eq!(a.nic(0).counters().bytes + a.nic(1).counters().bytes, 64 << 20);
    assert_eq!(a.stat("a0.inflight") + a.stat("a1.inflight"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_affinity_keeps_host_memory_on_its_numa_node() {
    let data_path = DataPath { strict_affinity: true, ..DataPath::default() };
    let cfg = RdmaConfig { data_path, ..RdmaConfig::default() };
    let fabric = SoftFabric::new();
    let node = tensorwire_rdma::affinity::numa_node_of(vec![0u8; 4096].as_ptr() as usize);
    let Some(node) = node else {
        eprintln!("SKIPPED: the kernel reports no NUMA node for host memory here");
        return;
    };
    let far = node + 1;
    let a =
        side(&fabric, vec![named("near", Some(node)), named("far", Some(far))], cfg.clone(), false)
            .await;
    let b = side(&fabric, vec![named("b0", None), named("b1", None)], cfg, false).await;
    write_and_check(&a, &b, 16 << 20, 2).await;
    assert_eq!(a.stat("near.bytes"), 16 << 20, "the NIC on the memory's node carries it all");
    assert_eq!(a.stat("far.bytes"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rail_hands_its_slices_to_the_others_and_comes_back() {
    let backoff = tensorwire_rdma::rails::Backoff {
        first: Duration::from_millis(20),
        max: Duration::from_millis(200),
    };
    let cfg = RdmaConfig {
        data_path: DataPath { backoff, ..DataPath::default() },
        ..RdmaConfig::default()
    };
    let (a, b) = pair(cfg, false).await;
    a.nic(0).fail_next(1, WcStatus::RetryExceeded);
    write_and_check(&a, &b, 32 << 20, 3).await;
    assert_eq!(a.stat("a0.errors"), 1, "one request failed, on a0");
    assert!(a.stat("a1.bytes") > 0);
    // The rail is rebuilt after its pause: a0 carries bytes again.
    let before = a.stat("a0.bytes");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seed = 4;
    while a.stat("a0.bytes") == before {
        assert!(Instant::now() < deadline, "a0 never carried bytes again");
        write_and_check(&a, &b, 8 << 20, seed).await;
        seed = seed.wrapping_add(1);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_nic_leaves_the_other_to_carry_everything() {
    let (a, b) = pair(RdmaConfig::default(), false).await;
    write_and_check(&a, &b, 4 << 20, 5).await;
    a.nic(0).vanish();
    let before = a.stat("a1.bytes");
    write_and_check(&a, &b, 32 << 20, 6).await;
    assert!(a.stat("a1.bytes") - before >= 32 << 20, "a1 carried the whole op");
    // The vanished NIC's rails cannot be rebuilt; the connection keeps working on a1.
    tokio::time::sleep(Duration::from_millis(200)).await;
    write_and_check(&a, &b, 1 << 20, 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_rail_left_an_op_falls_back_to_tcp_and_stays_in_order() {
    let (a, b) = pair(RdmaConfig::default(), true).await;
    write_and_check(&a, &b, 1 << 20, 8).await;
    let len = 8u64 << 20;
    let src = a.engine.alloc(len, Permissions::NONE).await.unwrap();
    let data = pattern(len as usize, 9);
    src.write_bytes(0, &data).unwrap();
    let dst = b.engine.alloc(len, Permissions::WRITE).await.unwrap();
    let s = a.engine.connect(b.engine.local_addr()).await.unwrap();
    // The peer's NICs go after its region was registered with them.
    b.nic(0).vanish();
    b.nic(1).vanish();
    let t0 = Instant::now();
    let h = s.submit(vec![TransferOp::write(&src, 0, &dst.remote(), 0, len)]).await;
    // A notification sent after the op arrives after its bytes, even though tcp moved them.
    let notify = s.notify(bytes::Bytes::from_static(b"after"));
    let (r, n) =
        tokio::join!(bounded("write", h.into_iter().next().unwrap()), bounded("notify", notify));
    r.unwrap();
    n.unwrap();
    let got = bounded("notification", b.engine.recv_notification(Duration::from_secs(10))).await;
    assert_eq!(got.unwrap().payload.as_ref(), b"after");
    assert!(dst.to_vec(0, len).unwrap() == data, "bytes differ after the fallback");
    assert!(a.stat("a0.errors") + a.stat("a1.errors") >= 2, "both NICs' rails failed first");
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_another_backend_a_lost_peer_nic_is_a_peer_failure() {
    let (a, b) = pair(RdmaConfig::default(), false).await;
    write_and_check(&a, &b, 1 << 20, 10).await;
    let src = a.engine.alloc(1 << 20, Permissions::NONE).await.unwrap();
    let dst = b.engine.alloc(1 << 20, Permissions::WRITE).await.unwrap();
    let s = a.engine.connect(b.engine.local_addr()).await.unwrap();
    b.nic(0).vanish();
    b.nic(1).vanish();
    let e = bounded("write", s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 1 << 20)))
        .await
        .unwrap_err();
    assert!(e.is_peer_failure(), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_access_is_an_error_and_never_retried() {
    let (a, b) = pair(RdmaConfig::default(), false).await;
    let src = a.engine.alloc(1 << 20, Permissions::NONE).await.unwrap();
    let dst = b.engine.alloc(1 << 20, Permissions::WRITE).await.unwrap();
    // The right access key (the lease is granted) but forged NIC keys in the blob.
    let mut forged: RemoteRegion = dst.remote();
    for (name, blob) in &mut forged.blobs {
        if name == "rdma" {
            let mut keys = tensorwire_rdma::blob::RegionKeys::decode(blob).unwrap();
            for k in &mut keys.0 {
                k.1 ^= 0x5a5a;
            }
            *blob = keys.encode().into();
        }
    }
    let s = a.engine.connect(b.engine.local_addr()).await.unwrap();
    let e = bounded("write", s.transfer(TransferOp::write(&src, 0, &forged, 0, 4096)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::AccessDenied(_)), "{e}");
    assert_eq!(a.stat("a0.errors") + a.stat("a1.errors"), 1, "refused once, not retried");
    // The rail's QP is rebuilt at once; the genuine region still works.
    bounded("write", s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 4096))).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_past_4_gib_register_and_move_at_their_far_end() {
    let (a, b) = pair(RdmaConfig::default(), false).await;
    let big = 5u64 << 30;
    let far = b.engine.alloc(big, Permissions::READ_WRITE).await.unwrap();
    let local = a.engine.alloc(big, Permissions::NONE).await.unwrap();
    let (off, len) = (big - (3 << 20) - 123, 2u64 << 20);
    let data = pattern(len as usize, 11);
    local.write_bytes(off, &data).unwrap();
    let s = a.engine.connect(b.engine.local_addr()).await.unwrap();
    bounded("write", s.transfer(TransferOp::write(&local, off, &far.remote(), off, len)))
        .await
        .unwrap();
    assert!(far.to_vec(off, len).unwrap() == data);
    bounded("read", s.transfer(TransferOp::read(&local, 7, &far.remote(), off, len)))
        .await
        .unwrap();
    assert!(local.to_vec(7, len).unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_on_a_slow_nic_lands_nothing_after_the_drop() {
    let cfg = RdmaConfig { cancel_timeout: Duration::from_millis(50), ..RdmaConfig::default() };
    let (a, b) = pair(cfg, false).await;
    let len = 32u64 << 20;
    let src = b.engine.alloc(len, Permissions::READ).await.unwrap();
    src.write_bytes(0, &vec![0xab; len as usize]).unwrap();
    let dst = a.engine.alloc(len, Permissions::NONE).await.unwrap();
    let s = a.engine.connect(b.engine.local_addr()).await.unwrap();
    bounded("warm", s.transfer(TransferOp::read(&dst, 0, &src.remote(), 0, 4096))).await.unwrap();
    for i in 0..2 {
        a.nic(i).set_delay(Duration::from_millis(20));
    }
    let mut hs = s.submit(vec![TransferOp::read(&dst, 0, &src.remote(), 0, len)]).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    let t0 = Instant::now();
    drop(hs.pop());
    let waited = t0.elapsed();
    let snapshot = dst.to_vec(0, len).unwrap();
    for i in 0..2 {
        a.nic(i).set_delay(Duration::ZERO);
    }
    // The connection recovers (QPs that were moved to ERROR are rebuilt) and reads again.
    let other = a.engine.alloc(4096, Permissions::NONE).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match bounded("read", s.transfer(TransferOp::read(&other, 0, &src.remote(), 0, 4096))).await
        {
            Ok(_) => break,
            Err(e) => assert!(Instant::now() < deadline, "the connection never recovered: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(dst.to_vec(0, len).unwrap() == snapshot, "bytes landed after the drop returned");
    assert!(waited < Duration::from_secs(5), "the drop waited {waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_on_the_control_channel_leaves_the_backend_working() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let secret = tensorwire_core::ClusterSecret::new([7u8; 32]);
    let config = EngineConfig { cluster_secret: Some(secret), ..EngineConfig::default() };
    let fabric = SoftFabric::new();
    let mk = |p: &str| {
        let nics = SoftProvider::with(&fabric, vec![named(&format!("{p}0"), None)]);
        RdmaBackend::new(RdmaConfig::default(), nics).unwrap()
    };
    let (ra, rb) = (mk("a"), mk("b"));
    let control = rb.control_addr();
    let a = Engine::builder().backend(ra).config(config.clone()).start().await.unwrap();
    let b = Engine::builder().backend(rb).config(config).start().await.unwrap();
    // Garbage, a truncated frame, and a peer without the secret: each is refused.
    for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[b'T', b'R', 1, 0xf1, 0xff, 0xff, 0xff, 0x7f][..]]
    {
        let mut c = tokio::net::TcpStream::connect(control).await.unwrap();
        c.write_all(junk).await.unwrap();
        let mut buf = [0u8; 256];
        let _ = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await;
    }
    let mut c = tokio::net::TcpStream::connect(control).await.unwrap();
    let hs = tensorwire_proto::handshake::Handshake {
        framing: &tensorwire_rdma::wire::FRAMING,
        secret: None,
        peer: control,
    };
    assert!(hs.client(&mut c).await.is_err(), "a peer without the secret is refused");
    let src = a.alloc(1 << 20, Permissions::NONE).await.unwrap();
    let dst = b.alloc(1 << 20, Permissions::WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let r = bounded("write", s.transfer(TransferOp::write(&src, 0, &dst.remote(), 0, 1 << 20)))
        .await
        .unwrap();
    assert_eq!(r.backend, "rdma");
}
