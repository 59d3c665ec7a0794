//! The linger (`tensorwire_core::linger`): its tasks start on activity, at most two, end after
//! the span, give their places back when their runtime goes, and none start when it is off.
//!
//! A test binary of its own: the linger is process-wide, and the transfers of other tests
//! running beside these would arm it too.

#![cfg(not(loom))] // the linger drives tokio tasks; the loom build has only the sans-IO pieces

use std::time::{Duration, Instant};

use tensorwire_core::linger;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Waits up to 10 s for `read()` to give `n`; returns what it gives then.
fn settle(n: usize, read: impl Fn() -> usize) -> usize {
    let start = Instant::now();
    while read() != n && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    read()
}

/// Waits up to 10 s for `awake()` to read `n`.
fn until_awake(n: usize) -> usize {
    settle(n, linger::awake)
}

/// Tasks alive on `rt` (the linger's are the only ones these tests leave running).
fn tasks(rt: &tokio::runtime::Runtime) -> usize {
    rt.metrics().num_alive_tasks()
}

#[test]
fn the_linger_starts_on_activity_ends_after_its_span_and_stays_bounded() {
    // Outside a runtime, arming does nothing (and does not panic).
    linger::arm();
    assert_eq!(linger::awake(), 0);

    // Off: nothing starts.
    let before = linger::set_span(Duration::ZERO);
    assert_eq!(before, linger::DEFAULT, "TENSORWIRE_LINGER_US is not set in the test run");
    let rt = runtime();
    rt.block_on(async {
        linger::arm();
        linger::arm_on(&tokio::runtime::Handle::current());
    });
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(linger::awake(), 0, "a linger that is off started a task");

    // On: two tasks, however often it is armed, and none once the span has passed.
    assert_eq!(linger::set_span(Duration::from_millis(50)), Duration::ZERO);
    rt.block_on(async {
        for _ in 0..10 {
            linger::arm();
        }
    });
    assert_eq!(until_awake(linger::AWAKE), linger::AWAKE);
    assert_eq!(until_awake(0), 0, "lingering tasks outlived their span");
    assert_eq!(settle(0, || tasks(&rt)), 0, "lingering tasks did not end");

    // They stay for the span (1 s here; looked at well before it ends).
    linger::set_span(linger::MAX);
    rt.block_on(async { linger::arm() });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(linger::awake(), linger::AWAKE, "lingering tasks left before their span ended");
    assert_eq!(tasks(&rt), linger::AWAKE);
    // A runtime that goes away while its tasks linger gives their places back.
    drop(rt);
    assert_eq!(until_awake(0), 0, "a dropped lingering task kept its place");

    // ... and a later arm starts tasks again.
    let rt = runtime();
    linger::arm_on(rt.handle());
    assert_eq!(until_awake(linger::AWAKE), linger::AWAKE);
    linger::set_span(Duration::ZERO);
    drop(rt);
    assert_eq!(until_awake(0), 0);

    // The span is bounded.
    linger::set_span(Duration::from_secs(5));
    assert_eq!(linger::span(), linger::MAX);
    linger::set_span(before);
}
