//! `tensorwire serve` with the orchestrator service and three `tensorwire worker` processes:
//! requests submitted to the service complete, also across a SIGKILL of the service process
//! when it keeps a journal. A port already in use is one clear error line.
//! Secure by default: a reachable listener needs a secret or `--insecure` (which warns), secret
//! files are made private by `tensorwire secret new` and bad ones are refused with their reason.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tensorwire_core::ClusterSecret;
use tensorwire_orchestrator::Priority;
use tensorwire_orchestrator::service::SubmitClient;

use crate::common::Kill;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_three_workers_complete_requests() {
    let dir = std::env::temp_dir().join(format!("tw-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    let _ = std::fs::remove_file(&secret_file);
    let exe = env!("CARGO_BIN_EXE_tensorwire");
    let made = Command::new(exe).arg("secret").arg("new").arg(&secret_file).output().unwrap();
    assert!(made.status.success(), "{made:?}");
    let serve = Command::new(exe)
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
    let (_serve, orch) = serving(serve);
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
    let secret = ClusterSecret::from_file(&secret_file).unwrap();
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

/// A `serve` process (stdout piped) once it printed its orchestrator's address, and the
/// address.
fn serving(mut serve: Child) -> (Kill, String) {
    let out = BufReader::new(serve.child_stdout());
    let serve = Kill(serve);
    let orch = out
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("orchestrator ").map(str::to_string))
        .expect("serve printed the orchestrator address");
    (serve, orch)
}

/// `tensorwire serve` with the orchestrator on `at` and its journal in `dir`; returns the
/// process once it listens.
fn orchestrator_process(at: &str, dir: &std::path::Path) -> Kill {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--store-mib", "16", "--for-secs", "120", "--orchestrator-listen", at])
        .arg("--journal")
        .arg(dir.join("orchestrator.journal"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(c.child_stdout());
    let up = out.lines().map_while(Result::ok).any(|l| l.starts_with("orchestrator "));
    assert!(up, "serve did not start its orchestrator");
    Kill(c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orchestrator_survives_sigkill_and_every_request_completes_once() {
    let dir = std::env::temp_dir().join(format!("tw-sigkill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let at = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let mut serve = orchestrator_process(&at, &dir);
    let mut workers = Vec::new();
    for role in ["encode", "denoise", "decode"] {
        let c = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
            .args(["worker", "--role", role, "--connect", &at, "--time-scale", "0.005"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.push(Kill(c));
    }
    let sub = SubmitClient::connect(at.parse().unwrap(), None).await.unwrap();
    let mut outs = Vec::new();
    for r in 0..24 {
        outs.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    let mut outs = outs.into_iter();
    for o in outs.by_ref().take(4) {
        let r = tokio::time::timeout(Duration::from_secs(60), o).await.expect("hung").unwrap();
        assert!(r.is_ok(), "{r:?}");
    }
    // SIGKILL mid-run, then the same command again: the journal brings every request back.
    serve.0.kill().unwrap();
    serve.0.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _serve = orchestrator_process(&at, &dir);
    for (i, o) in outs.enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(60), o).await;
        assert!(matches!(r, Ok(Ok(Ok(())))), "request {}: {r:?}", i + 4);
    }
    drop(workers);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker process that moves real payloads through the store node of `serve`.
fn payload_worker(role: &str, orch: &str, store: &(String, String), extra: &[&str]) -> Kill {
    let c = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["worker", "--role", role, "--connect", orch, "--time-scale", "0.1"])
        .args(["--store-engine", &store.0, "--store", &store.1])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    Kill(c)
}

/// The first line of `out` that starts with `prefix`, within 60 s.
fn line_starting(out: &mut impl BufRead, prefix: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut l = String::new();
    while std::time::Instant::now() < deadline {
        l.clear();
        if out.read_line(&mut l).unwrap() == 0 {
            break;
        }
        if l.starts_with(prefix) {
            return l.trim().to_string();
        }
    }
    panic!("no line starting with {prefix:?}");
}

/// A denoise worker process that saves step checkpoints to the store is killed (SIGKILL)
/// between two of them; the job resumes on a second worker process from the last checkpoint
/// the first saved (the worker checks the bytes it loads against the trajectory), and the
/// request completes with the right latents (decode checks every byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denoise_worker_killed_mid_job_resumes_from_its_last_checkpoint_elsewhere() {
    let mut serve = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--orchestrator-listen", "127.0.0.1:0", "--store-mib", "64", "--for-secs", "120"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(serve.child_stdout());
    let _serve = Kill(serve);
    let engine = line_starting(&mut out, "engine ");
    let node = line_starting(&mut out, "store node ");
    let orch = line_starting(&mut out, "orchestrator ");
    let word = |l: &str, i: usize| l.split_whitespace().nth(i).unwrap().to_string();
    let store = (word(&engine, 3), word(&node, 2));
    let orch = word(&orch, 1);
    let _enc = payload_worker("encode", &orch, &store, &[]);
    let _dec = payload_worker("decode", &orch, &store, &[]);
    let mut first = payload_worker("denoise", &orch, &store, &["--checkpoint-every", "3"]);
    let mut said = BufReader::new(first.0.child_stdout());
    line_starting(&mut said, "@@JOINED");
    let sub = SubmitClient::connect(orch.parse().unwrap(), None).await.unwrap();
    let done = sub.submit(0, Priority::Batch).await.unwrap();
    assert_eq!(line_starting(&mut said, "@@CHECKPOINT"), "@@CHECKPOINT 0 3");
    assert_eq!(line_starting(&mut said, "@@CHECKPOINT"), "@@CHECKPOINT 0 6");
    // Steps take about 95 ms: kill it between the checkpoints of steps 6 and 9.
    tokio::time::sleep(Duration::from_millis(120)).await;
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    // Its last words: a slow machine may have let it reach step 9's checkpoint.
    let last = said
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("@@CHECKPOINT 0 ").map(str::to_string))
        .last()
        .unwrap_or_else(|| "6".into());
    let mut second = payload_worker("denoise", &orch, &store, &["--checkpoint-every", "3"]);
    let mut said = BufReader::new(second.0.child_stdout());
    assert_eq!(line_starting(&mut said, "@@RESUMED"), format!("@@RESUMED 0 {last}"));
    let r = tokio::time::timeout(Duration::from_secs(60), done).await.expect("request hung");
    assert!(matches!(r, Ok(Ok(()))), "{r:?}");
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

fn tensorwire(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tensorwire")).args(args).output().unwrap()
}

#[test]
fn a_reachable_listener_needs_a_secret_or_insecure() {
    let open = ["serve", "--listen", "0.0.0.0:0", "--store-listen", "0.0.0.0:0", "--for-secs", "1"];
    let out = tensorwire(&open);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tensorwire secret new") && err.contains("--insecure"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let out = tensorwire(&[&open[..], &["--insecure"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("WARN") && err.contains("insecure"), "no warning: {err}");

    // A worker does not join an orchestrator on another host unauthenticated by accident.
    let out = tensorwire(&["worker", "--role", "decode", "--connect", "10.255.255.1:7200"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--insecure"), "{err}");
}

#[test]
fn secret_files_are_private_and_bad_ones_are_refused_with_their_reason() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("tw-secret-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("secret");
    let _ = std::fs::remove_file(&f);
    let path = f.to_str().unwrap();
    assert!(tensorwire(&["secret", "new", path]).status.success());
    assert_eq!(std::fs::metadata(&f).unwrap().permissions().mode() & 0o777, 0o600);
    let again = tensorwire(&["secret", "new", path]);
    assert!(!again.status.success(), "overwrote an existing secret");

    let serve = |file: &str| {
        let local = ["--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0", "--for-secs", "0"];
        tensorwire(&[&["serve", "--secret-file", file][..], &local].concat())
    };
    assert!(serve(path).status.success());
    let cases = [
        ("00112233445566778899aabbccddeeff", 0o644, "readable by group or others"),
        ("0011223344556677", 0o600, "needs at least 16"),
        ("correct horse battery staple", 0o600, "hex"),
    ];
    for (text, mode, why) in cases {
        std::fs::write(&f, text).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = serve(path);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{text:?} {mode:o}: {err}");
        assert!(!err.contains(text), "the error shows the secret: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_rebalance_moves_a_worker_that_can_decode_to_the_short_decode_pool() {
    let exe = env!("CARGO_BIN_EXE_tensorwire");
    let serve = Command::new(exe)
        .args(["serve", "--listen", "127.0.0.1:0", "--store-listen", "127.0.0.1:0"])
        .args(["--orchestrator-listen", "127.0.0.1:0", "--store-mib", "16", "--for-secs", "90"])
        .args(["--rebalance", "--rebalance-interval-s", "0.1", "--dwell-s", "0"])
        .args(["--horizon-s", "30"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (_serve, orch) = serving(serve);
    // Denoise 236 ms an item on each of three workers; decode 236 ms on one: decode is short.
    let worker = |role: &str, scale: &str, extra: &[&str]| {
        Command::new(exe)
            .args(["worker", "--role", role, "--connect", &orch, "--time-scale", scale])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Every worker's stdout is read: "joined" lines go to `joined`, the mobile worker's
    // "@@SWITCHED" to `switched`.
    let (joined_tx, joined) = std::sync::mpsc::sync_channel(16);
    let (tx, switched) = std::sync::mpsc::sync_channel(16);
    let watch = |mut child: Child| {
        let lines = BufReader::new(child.child_stdout());
        let (joined_tx, tx) = (joined_tx.clone(), tx.clone());
        std::thread::spawn(move || {
            for l in lines.lines().map_while(Result::ok) {
                if l.starts_with("@@SWITCHED") {
                    let _ = tx.send(l);
                } else if l.starts_with("worker ") && l.contains(" joined ") {
                    let _ = joined_tx.send(());
                }
            }
        });
        Kill(child)
    };
    let _workers: Vec<Kill> = [
        worker("denoise", "0.005", &["--can", "decode"]),
        worker("encode", "0.005", &[]),
        worker("denoise", "0.005", &[]),
        worker("denoise", "0.005", &[]),
        worker("decode", "0.1", &[]),
    ]
    .into_iter()
    .map(watch)
    .collect();
    // Submit only once all five joined (on a loaded machine a process can take seconds to start,
    // and a worker that joins after the work is done is never moved).
    for i in 0..5 {
        let got = tokio::task::block_in_place(|| joined.recv_timeout(Duration::from_secs(60)));
        assert!(got.is_ok(), "only {i} of 5 workers joined within 60 s");
    }
    let sub = SubmitClient::connect(orch.parse().unwrap(), None).await.unwrap();
    let mut outs = Vec::new();
    for r in 0..24 {
        outs.push(sub.submit(r, Priority::Batch).await.unwrap());
    }
    let l = tokio::task::spawn_blocking(move || switched.recv_timeout(Duration::from_secs(60)))
        .await
        .unwrap()
        .expect("the worker that can decode was moved");
    assert!(l.starts_with("@@SWITCHED denoise decode "), "{l}");
    for o in outs {
        let r =
            tokio::time::timeout(Duration::from_secs(60), o).await.expect("request hung").unwrap();
        assert!(r.is_ok(), "{r:?}");
    }
}
