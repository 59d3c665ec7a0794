//! `tensorwire serve` with the orchestrator service and three `tensorwire worker` processes:
//! requests submitted to the service complete. A port already in use is one clear error line.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tensorwire_core::auth::ClusterSecret;
use tensorwire_orchestrator::Priority;
use tensorwire_orchestrator::service::SubmitClient;

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_three_workers_complete_requests() {
    let dir = std::env::temp_dir().join(format!("tw-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, "a cluster secret of enough bytes").unwrap();
    let exe = env!("CARGO_BIN_EXE_tensorwire");
    let mut serve = Command::new(exe)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--store-listen",
            "127.0.0.1:0",
            "--orchestrator-listen",
            "127.0.0.1:0",
            "--store-mib",
            "16",
            "--for-secs",
            "60",
        ])
        .arg("--secret-file")
        .arg(&secret_file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(serve.child_stdout());
    let _serve = Kill(serve);
    let orch = out
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("orchestrator ").map(str::to_string))
        .expect("serve printed the orchestrator address");
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        let c = Command::new(exe)
            .args([
                "worker",
                "--role",
                role,
                "--connect",
                &orch,
                "--time-scale",
                "0.001",
                "--slots",
                "2",
            ])
            .arg("--secret-file")
            .arg(&secret_file)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(c));
    }
    let secret = ClusterSecret::new("a cluster secret of enough bytes");
    let sub = SubmitClient::connect(orch.parse().unwrap(), Some(&secret)).await.unwrap();
    let mut outs = Vec::new();
    for r in 0..6 {
        outs.push(sub.submit(r, Priority::Interactive).await.unwrap());
    }
    for o in outs {
        let r =
            tokio::time::timeout(Duration::from_secs(60), o).await.expect("request hung").unwrap();
        assert!(r.is_ok(), "{r:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

trait Stdout {
    fn child_stdout(&mut self) -> std::process::ChildStdout;
}

impl Stdout for Child {
    fn child_stdout(&mut self) -> std::process::ChildStdout {
        self.stdout.take().unwrap()
    }
}

/// Runs the CLI with `args`, expecting it to fail with one line on stderr that names `addr`.
fn fails_naming(args: &[&str], addr: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorwire")).args(args).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(addr), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn port_in_use_is_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    fails_naming(&["serve", "--listen", &addr, "--for-secs", "1"], &addr);
    drop(taken); // now nothing listens there: the worker cannot reach it
    fails_naming(&["worker", "--role", "decode", "--connect", &addr], &addr);
}
