//! Child processes of an integration-test binary: a test re-runs its own binary as a child
//! ([`child_command`]) to get a second process (a peer engine, a worker that is killed, a body
//! whose descriptor counts no other test moves). The binary names its child entry points once,
//! with [`children!`](crate::children), which expands to one `#[test]` marked `#[ignore]` with the
//! reason (it is not a test, so a normal run reports it ignored, never passed); a child is that
//! test run alone (`--exact`, `--include-ignored`) with [`CHILD_ENV`] naming the entry point and
//! [`ARGS_ENV`] carrying its arguments.
//!
//! ```ignore
//! // tests/it/main.rs
//! mod two_process;
//! tensorwire_conformance::children! { "worker" => two_process::worker }
//!
//! // tests/it/two_process.rs
//! pub fn worker(args: Vec<String>) -> tensorwire_conformance::harness::ChildBody {
//!     Box::pin(async move { /* the child's body */ })
//! }
//! #[test]
//! fn a_test() {
//!     tensorwire_conformance::harness::block_on(async {
//!         let child = tensorwire_conformance::harness::child_command("worker", &["x"]).spawn();
//!     })
//! }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::process::Command;

/// The environment variable naming the child entry point a re-run binary is.
pub const CHILD_ENV: &str = "TENSORWIRE_HARNESS_CHILD";
/// The environment variable carrying a child's arguments, separated by ASCII unit separators.
pub const ARGS_ENV: &str = "TENSORWIRE_HARNESS_ARGS";
/// The name of the test [`children!`](crate::children) defines at the root of a test binary.
pub const CHILD_TEST: &str = "harness_child";

/// What a child entry point runs.
pub type ChildBody = Pin<Box<dyn Future<Output = ()>>>;
/// A child entry point: its arguments in, its body out.
pub type Child = fn(Vec<String>) -> ChildBody;

/// A command that runs this test binary as child entry point `name` with `args`.
pub fn child_command(name: &str, args: &[&str]) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut c = Command::new(exe);
    c.args([CHILD_TEST, "--exact", "--include-ignored", "--nocapture", "--test-threads=1", "-q"]);
    c.env(CHILD_ENV, name).env(ARGS_ENV, args.join("\u{1f}"));
    c
}

/// A tokio runtime like a test's (two worker threads), running `f` to its end.
pub fn block_on<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(f)
}

/// The body of the test [`children!`](crate::children) defines: when this process was started as
/// a child, runs that entry point and exits (0 when it returned; a panic fails the process);
/// otherwise (the test run on its own with `--include-ignored`) does nothing.
pub fn child_main(children: &[(&str, Child)]) {
    let Ok(name) = std::env::var(CHILD_ENV) else { return };
    let Some((_, body)) = children.iter().find(|(n, _)| *n == name) else {
        panic!("no child entry point {name:?} in this binary");
    };
    let args = std::env::var(ARGS_ENV).unwrap_or_default();
    let args = if args.is_empty() {
        Vec::new()
    } else {
        args.split('\u{1f}').map(str::to_string).collect()
    };
    println!(); // the child's own lines start on a line of their own, after libtest's
    block_on(body(args));
    use std::io::Write;
    let _ = std::io::stdout().flush();
    std::process::exit(0);
}

/// Names the child entry points of a test binary (at its root, once): `"name" => function`,
/// each function a [`Child`].
#[macro_export]
macro_rules! children {
    ($($name:literal => $body:path),* $(,)?) => {
        #[test]
        #[ignore = "not a test: the entry point of this binary's child processes"]
        fn harness_child() {
            $crate::harness::child_main(&[$(($name, $body as $crate::harness::Child)),*]);
        }
    };
}
