//! A process may exit right after dropping (or shutting down) its UCX backends, while their
//! progress threads are still tearing UCX down: exit must be clean, not an abort inside libucs.
//! The parent re-runs this test binary as children (the entry point "exit") that do exactly
//! that, several times, since the window is a race.

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tensorwire_core::{Engine, Permissions, TransferOp};
use tensorwire_ucx::{UcxBackend, UcxConfig};

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

/// The child entry point "exit": `mode` and `tls`.
pub(crate) fn exit_child(args: Vec<String>) -> tensorwire_conformance::harness::ChildBody {
    Box::pin(async move { child(&args[0], &args[1]).await })
}

#[test]
fn exit_right_after_dropping_backends_is_clean() {
    for i in 0..CHILDREN {
        let mode = ["drop", "shutdown", "busy"][i % 3];
        let tls = ["tcp", "sm,self"][i / 3 % 2];
        let mut kid = tensorwire_conformance::harness::child_command("exit", &[mode, tls])
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
