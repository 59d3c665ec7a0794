//! A test runner for test binaries that re-run themselves as child processes (a `[[test]]` with
//! `harness = false`). Child entry points are named and started explicitly ([`child_command`]),
//! so they are never counted as tests (libtest would run them, and report them passed). The output
//! mimics libtest's (`test NAME ... ok`, `test result: ...`) and the usual arguments work: a name
//! filter, `--exact`, `--list`, `--ignored`; others (`--nocapture`, `--test-threads`) are accepted
//! and ignored (the tests run one after another, each on a fresh tokio runtime).
//!
//! ```ignore
//! // tests/two_process.rs, with `[[test]] name = "two_process" harness = false`
//! fn main() -> std::process::ExitCode {
//!     tensorwire_conformance::harness::Harness::new()
//!         .test("a_test", || async { /* spawns child_command("worker") */ })
//!         .child("worker", |args| async move { /* the child's body */ })
//!         .run()
//! }
//! ```

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::process::{Command, ExitCode};

/// The environment variable naming the child entry point a re-run binary is.
pub const CHILD_ENV: &str = "TENSORWIRE_HARNESS_CHILD";

type Body = Box<dyn Fn(Vec<String>) -> Pin<Box<dyn Future<Output = ()>>>>;

/// The tests and child entry points of one test binary.
#[derive(Default)]
pub struct Harness {
    tests: Vec<(String, Body)>,
    children: Vec<(String, Body)>,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |v: &[(String, Body)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        f.debug_struct("Harness")
            .field("tests", &names(&self.tests))
            .field("children", &names(&self.children))
            .finish()
    }
}

/// A command that runs this binary as child entry point `name` (its arguments: add them).
pub fn child_command(name: &str) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut c = Command::new(exe);
    c.env(CHILD_ENV, name);
    c
}

impl Harness {
    /// No tests yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a test.
    pub fn test<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn() -> Fut + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        self.tests.push((name.into(), Box::new(move |_| Box::pin(f()))));
        self
    }

    /// Adds a child entry point; it gets the arguments the parent gave [`child_command`].
    pub fn child<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn(Vec<String>) -> Fut + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        self.children.push((name.into(), Box::new(move |a| Box::pin(f(a)))));
        self
    }

    /// Runs the child this process was started as, or else the tests the arguments select.
    pub fn run(self) -> ExitCode {
        let rt = || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a tokio runtime")
        };
        if let Ok(name) = std::env::var(CHILD_ENV) {
            let Some((_, body)) = self.children.iter().find(|(n, _)| *n == name) else {
                eprintln!("no child entry point {name:?} in this binary");
                return ExitCode::from(2);
            };
            rt().block_on(body(std::env::args().skip(1).collect()));
            return ExitCode::SUCCESS;
        }
        let args: Vec<String> = std::env::args().skip(1).collect();
        let flag = |f: &str| args.iter().any(|a| a == f);
        let filter = args.iter().find(|a| !a.starts_with('-'));
        let selected: Vec<&(String, Body)> = self
            .tests
            .iter()
            .filter(|(n, _)| match filter {
                None => true,
                Some(f) if flag("--exact") => n == f,
                Some(f) => n.contains(f.as_str()),
            })
            .filter(|_| !flag("--ignored")) // none of these tests is ignored
            .collect();
        if flag("--list") {
            for (n, _) in &selected {
                println!("{n}: test");
            }
            return ExitCode::SUCCESS;
        }
        let s = if selected.len() == 1 { "" } else { "s" };
        println!("\nrunning {} test{s}", selected.len());
        let mut failed = Vec::new();
        for (name, body) in &selected {
            let ok = std::panic::catch_unwind(AssertUnwindSafe(|| rt().block_on(body(Vec::new()))));
            println!("test {name} ... {}", if ok.is_ok() { "ok" } else { "FAILED" });
            if ok.is_err() {
                failed.push(name.clone());
            }
        }
        let passed = selected.len() - failed.len();
        let filtered = self.tests.len() - selected.len();
        if failed.is_empty() {
            println!("\ntest result: ok. {passed} passed; 0 failed; {filtered} filtered out\n");
            ExitCode::SUCCESS
        } else {
            println!("\nfailures:\n    {}", failed.join("\n    "));
            println!(
                "\ntest result: FAILED. {passed} passed; {} failed; {filtered} filtered out\n",
                failed.len()
            );
            ExitCode::from(101)
        }
    }
}
