//! A process may exit right after dropping (or shutting down) its UCX backends, while their
//! progress threads are still tearing UCX down: exit must be clean, not an abort inside libucs.
//! The parent re-runs this binary as children that do exactly that, several times, since the
//! window is a race.
#![cfg(feature = "ucx")]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_core::{Engine, Permissions, TransferOp};
use tensorwire_ucx::{UcxBackend, UcxConfig};

const CHILD: &str = "TENSORWIRE_UCX_EXIT_CHILD";
const CHILDREN: usize = 18;

/// The child's body: two engines move bytes, then everything is dropped and the process exits at
/// once: after a shutdown, after a plain drop, or with a large WRITE still moving.
async fn child(mode: &str, tls: &str) {
    let mk = || UcxBackend::with_config(UcxConfig::transports(tls)).unwrap();
    let a = Engine::builder().backend(mk()).start().await.unwrap();
    let b = Engine::builder().backend(mk()).start().await.unwrap();
    let len = 64 << 20;
    let la = a.alloc(len, Permissions::NONE).await.unwrap();
    let lb = b.alloc(len, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    s.transfer(TransferOp::write(&la, 0, &lb.remote(), 0, 1 << 20)).await.unwrap();
    s.transfer(TransferOp::read(&la, 0, &lb.remote(), 0, 1 << 20)).await.unwrap();
    match mode {
        "shutdown" => {
            a.shutdown().await;
            b.shutdown().await;
        }
        "busy" => {
            let big = s.transfer(TransferOp::write(&la, 0, &lb.remote(), 0, len));
            let _ = tokio::time::timeout(Duration::from_millis(3), big).await;
        }
        _ => {}
    }
}

#[test]
fn exit_right_after_dropping_backends_is_clean() {
    if let Ok(job) = std::env::var(CHILD) {
        let (mode, tls) = job.split_once('/').unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        rt.block_on(child(mode, tls));
        drop(rt);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for i in 0..CHILDREN {
        let mode = ["drop", "shutdown", "busy"][i % 3];
        let tls = ["tcp", "sm,self"][i / 3 % 2];
        let mut kid = Command::new(&exe)
            .args(["--exact", "exit_right_after_dropping_backends_is_clean", "--nocapture"])
            .env(CHILD, format!("{mode}/{tls}"))
            .env("UCX_NET_DEVICES", "lo")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = kid.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = kid.kill();
                let _ = kid.wait();
                panic!("child {i} ({mode}, {tls}) did not exit within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        let _ = kid.stderr.take().unwrap().read_to_string(&mut err);
        assert!(status.success(), "child {i} ({mode}, {tls}) ended with {status}:\n{err}");
    }
}
