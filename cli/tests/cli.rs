//! The `tensorwire` command from the outside: a short demo, a short simulation, and bad input
//! answered with one clear line and a non-zero exit (no panic, no backtrace).

use std::process::Command;

fn tensorwire(args: &[&str]) -> (bool, String, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_tensorwire")).args(args).output().expect("run tensorwire");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn short_demo_prints_both_layouts() {
    let (ok, out, err) = tensorwire(&["demo", "--requests", "6", "--time-scale", "0.005"]);
    assert!(ok, "{out}\n{err}");
    for row in ["disaggregated", "colocated", "TTFF p99", "throughput", "store objects left"] {
        assert!(out.contains(row), "missing {row:?} in:\n{out}");
    }
}

#[test]
fn short_simulation_reports_the_best_split() {
    let (ok, out, err) = tensorwire(&["simulate", "--requests", "2000", "--gpus", "5"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("best disaggregated / colocated throughput"), "{out}");
}

#[test]
fn bad_input_is_one_clear_line() {
    let dir = std::env::temp_dir().join(format!("tw-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[[model]]\nname = 3\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["demo".into(), "--models".into(), "nope".into()], "unknown model \"nope\""),
        (
            vec!["demo".into(), "--profiles".into(), bad.display().to_string()],
            "not a valid profile file",
        ),
        (vec!["demo".into(), "--profiles".into(), "/nonexistent/x.toml".into()], "cannot read"),
        (vec!["demo".into(), "--split".into(), "1:1".into()], "expected three numbers"),
        (vec!["simulate".into(), "--model".into(), "nope".into()], "unknown model"),
        (vec!["simulate".into(), "--policy".into(), "random".into()], "--policy"),
    ];
    for (args, want) in cases {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, _, err) = tensorwire(&a);
        assert!(!ok, "{a:?} succeeded");
        assert!(err.contains(want), "{a:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{a:?}: more than one line: {err}");
        assert!(!err.contains("panicked"), "{a:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
