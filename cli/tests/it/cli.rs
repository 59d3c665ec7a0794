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
    let rows = ["disaggregated", "colocated", "TTFF p99", "throughput", "store objects left"];
    for row in rows.into_iter().chain(["embedding cache hits", "CFG feature hits"]) {
        assert!(out.contains(row), "missing {row:?} in:\n{out}");
    }
    // The default scenario: colocated RTX 4090s offload (LightX2V's measured stage times).
    assert!(out.contains("scenario memory-bound"), "{out}");
    assert!(out.contains("encode: 12890 ms colocated on rtx4090 (measured)"), "{out}");
    assert!(out.contains("decided by"), "{out}");
    let args = ["demo", "--scenario", "fits", "--requests", "6", "--time-scale", "0.005"];
    let (ok, out, err) = tensorwire(&args);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("every stage runs at the same speed colocated and in its own pool"),
        "{out}"
    );
}

#[test]
fn short_demo_with_worker_processes() {
    let (ok, out, err) =
        tensorwire(&["demo", "--processes", "--requests", "6", "--time-scale", "0.005"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("worker processes"), "{out}");
    assert!(out.contains("checked by the workers"), "{out}");
    // Then an interactive request arrives while batch jobs hold every denoise worker.
    assert!(out.contains("preemption: with 6 batch jobs"), "{out}");
    // And a denoise worker process gets SIGTERM mid-job: it drains and exits, nothing is lost.
    assert!(out.contains("migration: the denoise worker running a batch job got SIGTERM"), "{out}");
    assert!(out.contains("all 6 requests completed"), "{out}");
    assert!(out.contains("step checkpoints (every 10 steps)"), "{out}");
}

#[test]
fn chaos_demo_loses_nothing() {
    // Worker processes killed with SIGKILL about every second and restarted by the demo's
    // supervisor: every request completes once and the store ends empty (the demo exits with
    // an error otherwise).
    let args = ["demo", "--processes", "--requests", "24", "--time-scale", "0.02"];
    let (ok, out, err) = tensorwire(&[&args[..], &["--chaos", "1", "--seed", "7"]].concat());
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("lost 0, duplicated 0"), "{out}");
    assert!(out.contains("store objects left 0"), "{out}");
    assert!(out.contains("restarted"), "{out}");
}

#[test]
fn store_chaos_demo_loses_nothing() {
    // Three store node processes behind the cluster store with two replicas; one is killed
    // with SIGKILL about every second and started again, empty. Every request completes once,
    // the repair refills the restarted nodes, and the store ends empty.
    let args = ["demo", "--processes", "--requests", "24", "--time-scale", "0.02"];
    let store = ["--store-nodes", "3", "--replicas", "2", "--chaos-store", "1", "--seed", "3"];
    let (ok, out, err) = tensorwire(&[&args[..], &store[..]].concat());
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("lost 0, duplicated 0"), "{out}");
    assert!(out.contains("store objects left 0"), "{out}");
    let line = out.lines().find(|l| l.starts_with("store: 3 nodes, 2 replicas")).expect(&out);
    let killed: u32 =
        line.split("; ").nth(1).and_then(|w| w.split(' ').next()?.parse().ok()).expect(line);
    assert!(killed > 0, "no store node was killed: {line}");
}

#[test]
fn simulated_preemption_shortens_the_interactive_tail() {
    // Deterministic (simulated time, a fixed seed): a fifth of the requests are interactive;
    // with preemption their p99 TTFF is about the pipeline's own time, without it they wait
    // for a batch job to end.
    let args = ["simulate", "--requests", "3000", "--split", "1:6:1", "--rate", "0.015"];
    let more = ["--interactive", "0.2", "--checkpoint-every", "10", "--embedding-hit-rate", "0.5"];
    let (ok, out, err) = tensorwire(&[&args[..], &more[..]].concat());
    assert!(ok, "{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("interactive TTFF p99")).expect(&out);
    let secs: Vec<f64> = line.split_whitespace().filter_map(|w| w.parse::<f64>().ok()).collect();
    assert!(secs[0] < secs[1], "with preemption {} s, without {} s", secs[0], secs[1]);
    assert!(out.contains("jobs preempted"), "{out}");
    assert!(out.contains("encode skipped for"), "{out}");
}

#[test]
fn short_simulation_reports_the_best_split() {
    let (ok, out, err) = tensorwire(&["simulate", "--requests", "2000", "--gpus", "5"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("best disaggregated / colocated throughput"), "{out}");
}

#[test]
fn simulator_meets_every_published_result() {
    // profiles/published.toml: each published disaggregated/colocated throughput ratio, with its
    // citation; the command fails if one is outside its tolerance with no mechanism named.
    let (ok, out, err) = tensorwire(&["simulate", "--calibrate"]);
    assert!(ok, "{out}\n{err}");
    assert!(!out.contains("MISSED"), "{out}");
    assert!(out.lines().filter(|l| l.contains(" vs EDV:")).count() >= 5, "{out}");
}

#[test]
fn plan_ranks_layouts_with_their_cost_and_reasons() {
    let mix = "flux.1-dev-1024=0.8:interactive,wan2.1-t2v-14b-480p=0.2:batch";
    let args = ["simulate", "--plan", "--budget-usd", "20", "--requests", "2000", "--mix", mix];
    let (ok, out, err) = tensorwire(&args);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("$/1k req"), "{out}");
    assert!(out.contains("capacity bound by the"), "{out}");
    assert!(out.contains("disaggregated vs colocated at equal GPU count"), "{out}");
    // A layout that cannot hold its models says why.
    let args = ["simulate", "--layout", "EDV@rtx4090:8", "--model", "wan2.1-14b-720p"];
    let (_, out, err) = tensorwire(&[&args[..], &["--requests", "500"]].concat());
    assert!(out.contains("infeasible") || err.contains("no layout fits"), "{out}\n{err}");
    assert!(out.contains("29.0 GB of activations do not fit a rtx4090"), "{out}");
}

#[test]
fn bad_input_is_one_clear_line() {
    let dir = std::env::temp_dir().join(format!("tw-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[[model]]\nname = 3\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["demo".into(), "--models".into(), "nope".into()], "unknown model \"nope\""),
        (vec!["demo".into(), "--scenario".into(), "nope".into()], "unknown scenario"),
        (
            vec!["demo".into(), "--profiles".into(), bad.display().to_string()],
            "not a valid profile file",
        ),
        (vec!["demo".into(), "--profiles".into(), "/nonexistent/x.toml".into()], "cannot read"),
        (vec!["demo".into(), "--split".into(), "1:1".into()], "expected three numbers"),
        (vec!["demo".into(), "--chaos".into(), "1".into()], "needs --processes"),
        (vec!["demo".into(), "--chaos-store".into(), "1".into()], "needs --store-nodes 2"),
        (vec!["demo".into(), "--store-nodes".into(), "3".into()], "needs --processes"),
        (vec!["soak".into(), "--minutes".into(), "0".into()], "--minutes 0"),
        (vec!["soak".into(), "--chaos".into(), "0.001".into()], "--chaos 0.001"),
        (vec!["simulate".into(), "--model".into(), "nope".into()], "unknown model"),
        (vec!["simulate".into(), "--policy".into(), "random".into()], "--policy"),
        (vec!["simulate".into(), "--layout".into(), "E:1|D:7".into()], "no pool serves stage V"),
        (vec!["simulate".into(), "--gpu".into(), "tpu".into()], "unknown GPU class"),
        (vec!["simulate".into(), "--mix".into(), "flux.1-dev-1024:urgent".into()], "--mix"),
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

#[test]
fn bench_writes_a_report_with_plots() {
    let dir = std::env::temp_dir().join(format!("tw-bench-{}", std::process::id()));
    let d = dir.display().to_string();
    let (ok, out, err) = tensorwire(&[
        "bench",
        "--out",
        &d,
        "--runs",
        "1",
        "--min-time-ms",
        "10",
        "--sizes",
        "4K,64K",
    ]);
    assert!(ok, "{out}\n{err}");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    for section in ["Backend `tcp`", "Backend `shm`", "## Store", "## Connector", "TTFF"] {
        assert!(md.contains(section), "report.md lacks {section:?}");
    }
    for section in ["(a) Throughput", "(b) Overlap", "(c) Decode-pool", "(d) Connector overhead"] {
        assert!(md.contains(section), "report.md lacks {section:?}");
    }
    let svgs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "svg"))
        .collect();
    assert!(svgs.len() >= 6, "{} plots", svgs.len());
    for p in svgs {
        let s = std::fs::read_to_string(p.path()).unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"), "{:?}", p.path());
        let name = p.file_name().into_string().unwrap();
        assert!(md.contains(&format!("({name})")), "report.md does not show {name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
