//! A peer process killed while this side copies into its region in `submit` (a lease on memory
//! the peer allocated through UCX, mapped here over shared memory): the mapping outlives the
//! peer, so copies after the kill never fault; ops end (landed or refused) and the backend shuts
//! down within its bound. The parent re-runs this test binary as the peer (the entry point "peer").

use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tensorwire_core::{Engine, MemoryKind, Permissions, RegionId, TransferOp};
use tensorwire_ucx::{UcxBackend, UcxConfig};

const LEN: u64 = 1 << 20;

/// The child entry point "peer".
pub(crate) fn peer_child(_: Vec<String>) -> tensorwire_conformance::harness::ChildBody {
    Box::pin(peer())
}

fn backend() -> std::sync::Arc<UcxBackend> {
    let cfg =
        UcxConfig { answer_timeout: Duration::from_secs(2), ..UcxConfig::transports("sm,self") };
    UcxBackend::with_config(cfg).unwrap()
}

/// The peer: UCX-allocated memory open to remote READ and WRITE, served until stdin closes.
async fn peer() {
    let u = backend();
    let e = Engine::builder().backend(u.clone()).start().await.unwrap();
    let m = u.allocate(LEN).await.unwrap();
    // SAFETY: the memory outlives the region (the process is killed, or the region goes
    // first below).
    let r =
        unsafe { e.register_raw(m.as_ptr(), LEN, MemoryKind::Host, Permissions::READ_WRITE).await }
            .unwrap();
    println!("READY {} {}", e.local_addr(), r.id().0);
    let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await;
    r.deregister().await.unwrap();
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_into_a_killed_peers_region_never_fault() {
    let mut kid = tensorwire_conformance::harness::child_command("peer", &[])
        .env("UCX_NET_DEVICES", "lo")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = kid.stdout.take().unwrap();
    let ready = tokio::task::spawn_blocking(move || {
        BufReader::new(out).lines().map_while(Result::ok).find_map(|l| {
            l.strip_prefix("READY ").map(|r| r.split_whitespace().map(String::from).collect())
        })
    })
    .await
    .unwrap();
    let ready: Vec<String> = ready.expect("the peer became ready");
    let (addr, id) = (ready[0].parse().unwrap(), RegionId(ready[1].parse().unwrap()));

    let u = backend();
    let a = Engine::builder().backend(u.clone()).start().await.unwrap();
    let m = u.allocate(LEN).await.unwrap();
    // SAFETY: the region is deregistered below, before `m` drops.
    let local =
        unsafe { a.register_raw(m.as_ptr(), LEN, MemoryKind::Host, Permissions::NONE).await }
            .unwrap();
    let s = a.connect(addr).await.unwrap();
    let remote = s.remote_region(id).unwrap();
    let write = |at: u64| TransferOp::write(&local, at, &remote, at, 4096);
    let read = |at: u64| TransferOp::read(&local, at, &remote, at, 4096);
    s.transfer(write(0)).await.unwrap(); // the lease
    s.transfer(read(0)).await.unwrap();
    let before = u.ops_copied_in_submit();
    for i in 0..100 {
        s.transfer(write(i * 4096 % LEN)).await.unwrap();
        s.transfer(read(i * 4096 % LEN)).await.unwrap();
    }
    assert_eq!(u.ops_copied_in_submit() - before, 200, "ops copied in submit");

    kid.kill().unwrap();
    kid.wait().unwrap();
    // Copies go on into the mapping the dead peer left (nothing tells this side it died:
    // no op on a lease waits for an answer); none may fault, each ends.
    let until = Instant::now() + Duration::from_millis(300);
    let mut ended = 0u64;
    while Instant::now() < until {
        let at = ended * 4096 % LEN;
        let _ = tokio::time::timeout(Duration::from_secs(10), s.transfer(write(at)))
            .await
            .expect("a WRITE after the peer died ended");
        let _ = tokio::time::timeout(Duration::from_secs(10), s.transfer(read(at)))
            .await
            .expect("a READ after the peer died ended");
        ended += 2;
    }
    assert!(ended > 0);
    drop(s);
    local.deregister().await.unwrap();
    drop(m);
    tokio::time::timeout(Duration::from_secs(15), a.shutdown())
        .await
        .expect("the backend shut down with its peer dead");
}
