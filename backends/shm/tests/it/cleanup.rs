//! Nothing outlives its engine: after a normal run and after a peer process is killed, this
//! process's descriptor table and its memfd mappings are back where they started, and /dev/shm
//! never saw a file. The check runs alone in a child process of this test binary (the entry
//! point "cleanup"), so no other test moves the counts while it runs; its killed peer is another
//! child ("cleanup-peer").

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_conformance::harness::{ChildBody, child_command};
use tensorwire_conformance::multiprocess::{child, spawn_child};
use tensorwire_core::{Engine, Permissions, TransferOp, backend::Backend};
use tensorwire_shm::ShmBackend;

fn shm() -> Arc<dyn Backend> {
    ShmBackend::new().expect("bind shm backend")
}

#[test]
fn nothing_outlives_its_engine() {
    let out = child_command("cleanup", &[]).output().expect("run the check in a child process");
    assert!(
        out.status.success(),
        "the check failed in its process ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child entry point "cleanup": the check, alone in its process.
pub(crate) fn cleanup_child(_: Vec<String>) -> ChildBody {
    Box::pin(check())
}

/// The child entry point "cleanup-peer": the peer that holds still until it is killed.
pub(crate) fn peer_child(args: Vec<String>) -> ChildBody {
    Box::pin(async move { child(shm, &args[0]).await })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    fds: usize,
    memfd_maps: usize,
}

fn counts() -> Counts {
    // Memfds and the shm backend's Unix sockets (listeners and accepted connections carry its
    // abstract name in /proc/net/unix) are what this backend creates; other descriptors (a test
    // runtime's epoll, libtest's own) come and go with the harness.
    let ours: std::collections::HashSet<String> = std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("@tensorwire-shm"))
        .filter_map(|l| l.split_whitespace().nth(6).map(|inode| format!("socket:[{inode}]")))
        .collect();
    let fds = open_fds().iter().filter(|l| l.contains("memfd:") || ours.contains(*l)).count();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    Counts { fds, memfd_maps: maps.lines().filter(|l| l.contains("memfd:tensorwire")).count() }
}

fn open_fds() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .collect()
}

fn dev_shm() -> usize {
    std::fs::read_dir("/dev/shm").map(|d| d.count()).unwrap_or(0)
}

/// Waits (bounded) until `counts()` satisfies `ok`.
async fn settle(what: &str, ok: impl Fn(Counts) -> bool) -> Counts {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = counts();
        if ok(c) {
            return c;
        }
        if Instant::now() >= deadline {
            panic!("{what}: still {c:?}; open: {:?}", open_fds());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn check() {
    let shm_files = dev_shm();
    let base = counts();

    // Normal ending: two engines map each other's regions, move bytes both ways, shut down.
    {
        let a = Engine::builder().backend(shm()).start().await.unwrap();
        let b = Engine::builder().backend(shm()).start().await.unwrap();
        let la = a.alloc(1 << 20, Permissions::READ_WRITE).await.unwrap();
        let lb = b.alloc(1 << 20, Permissions::READ_WRITE).await.unwrap();
        let s = a.connect(b.local_addr()).await.unwrap();
        s.transfer(TransferOp::write(&la, 0, &lb.remote(), 0, 1 << 20)).await.unwrap();
        s.transfer(TransferOp::read(&la, 0, &lb.remote(), 0, 1 << 20)).await.unwrap();
        let during = counts();
        assert!(during.memfd_maps >= base.memfd_maps + 3, "a's mapping of b's region: {during:?}");
        assert!(during.fds > base.fds, "memfds and shm sockets are counted: {during:?}");
        drop(s);
        la.deregister().await.unwrap();
        lb.deregister().await.unwrap();
        a.shutdown().await;
        b.shutdown().await;
    }
    settle("after a normal ending", |c| c == base).await;

    // Killed peer: we map the child's region (and our connection's live page), the child dies,
    // our mappings must go.
    let kid = spawn_child("cleanup-peer", "hold");
    let a = Engine::builder().backend(shm()).start().await.unwrap();
    let src = a.alloc(1 << 20, Permissions::NONE).await.unwrap();
    let own = counts();
    let s = a.connect(kid.addr).await.unwrap();
    let remote = s.remote_region(kid.region).unwrap();
    s.transfer(TransferOp::write(&src, 0, &remote, 0, 1 << 20)).await.unwrap();
    let mapped = counts();
    assert_eq!(
        mapped.memfd_maps,
        own.memfd_maps + 2,
        "we map the child's region and the live page of our connection"
    );
    drop(kid); // SIGKILL and reap
    settle("after the peer was killed", |c| c.memfd_maps == own.memfd_maps).await;
    let e = s.transfer(TransferOp::write(&src, 0, &remote, 0, 4096)).await.unwrap_err();
    assert!(e.is_peer_failure(), "{e}");
    drop(s);
    src.deregister().await.unwrap();
    a.shutdown().await;
    drop(a);
    settle("after the engine shut down", |c| c == base).await;
    assert_eq!(dev_shm(), shm_files, "/dev/shm changed");
}
