//! The scale bench (`xfer --scale`; a section of `tensorwire bench --scale`): how the cost of one
//! op grows with the work around it. Each curve holds everything fixed but one count and
//! measures the per-op time (and its inverse, ops per second) at points from its smallest count
//! to its largest, plus the memory each unit of the count costs where that is measurable:
//!
//! - `regions`: regions registered on each of two engines (tcp); a 4 KiB WRITE one at a time
//!   to a region in the middle of the peer's;
//! - `peers`: engines a client is connected to (tcp, every peer in this process); 4 KiB WRITEs
//!   round-robin over them;
//! - `batch`: 4 KiB ops per submit (tcp); the per-op time is the batch's over its ops;
//! - `store objects`: 64 KiB objects held by an embedded store; a put_from, get_into and
//!   remove of a fresh key (no memory figure: the pool's pages dominate the process's RSS);
//!   `small store objects`: the same with 4 KiB objects, up to 1,000,000 (4 GB of pool);
//! - `workers` and `requests in flight`: the orchestrator's scheduler core (one core, no I/O);
//!   the per-op time is one dispatch decision's;
//! - `service` and `service with journal`: requests in flight through the orchestrator service over
//!   TCP with 16 worker clients and a submitter (`crate::service`), without and with its
//!   journal; the per-op time is the run's wall time over its requests (the inverse of
//!   requests per second), each point the median of three runs.
//!
//! A curve's `growth` is its largest per-op time over the one at its smallest count; the target
//! is 1.5.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tensorwire_core::{DType, Engine, MemoryKind, Permissions, Region, TensorMeta, TransferOp};
use tensorwire_store::{EmbeddedStore, Retention, Store, StoreConfig};

use crate::Result;
use crate::orchestrator;
use crate::service;
use crate::transfer::{make_backend, submit_checked};

/// Bytes of each transfer op.
const OP: u64 = 4096;
/// Bytes of each store object.
const OBJECT: u64 = 64 << 10;

/// The largest count of each curve, and ops timed per point.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Regions per engine.
    pub regions: u64,
    /// Peer engines.
    pub peers: u64,
    /// Ops per submit.
    pub batch: u64,
    /// Store objects of 64 KiB.
    pub objects: u64,
    /// Store objects of 4 KiB.
    pub small_objects: u64,
    /// Scheduler workers.
    pub workers: u64,
    /// Requests in flight at the scheduler.
    pub in_flight: u64,
    /// Requests the scheduler completes, timed, at each point (after the requests in flight
    /// are submitted, untimed).
    pub sched_requests: u64,
    /// Requests in flight through the service.
    pub service_in_flight: u64,
    /// Most requests one service run completes (each run: 20 per request in flight, at least
    /// a tenth of this).
    pub service_requests: u64,
    /// Ops timed at each point (transfers and store).
    pub ops: u64,
}

impl Limits {
    /// What the issue asks for, as far as this machine holds it: 1,000,000 objects of 64 KiB
    /// would need 64 GB of pool, so 64 KiB objects stop at 100,000 (6.4 GB) and the 1,000,000
    /// are 4 KiB each (4 GB).
    pub fn full() -> Limits {
        Limits {
            regions: 100_000,
            peers: 64,
            batch: 4096,
            objects: 100_000,
            small_objects: 1_000_000,
            workers: 100_000,
            in_flight: 1_000_000,
            sched_requests: 50_000,
            service_in_flight: 1024,
            service_requests: 20_000,
            ops: 2000,
        }
    }

    /// Small counts for a smoke run (CI, the bench report by default).
    pub fn smoke() -> Limits {
        Limits {
            regions: 1000,
            peers: 8,
            batch: 256,
            objects: 2000,
            small_objects: 3000,
            workers: 1000,
            in_flight: 10_000,
            sched_requests: 5_000,
            service_in_flight: 64,
            service_requests: 2000,
            ops: 200,
        }
    }
}

/// One point of a curve.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Tells the line apart.
    pub scale: bool,
    /// The curve.
    pub curve: &'static str,
    /// The count.
    pub x: u64,
    /// Median time of one op, microseconds.
    pub per_op_us: f64,
    /// Ops per second (the inverse).
    pub ops_per_s: f64,
    /// Memory each unit of the count added (RSS growth over the count's growth), bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_unit: Option<f64>,
}

/// A whole curve.
#[derive(Debug, Clone, Serialize)]
pub struct Curve {
    /// Tells the line apart.
    pub scale_curve: bool,
    /// The curve.
    pub curve: &'static str,
    /// What the count counts.
    pub unit: &'static str,
    /// Its points, smallest count first.
    pub points: Vec<Point>,
    /// The largest per-op time over the one at the smallest count.
    pub growth: f64,
    /// Whether `growth` is within the 1.5 target.
    pub within_target: bool,
}

impl Curve {
    fn new(curve: &'static str, unit: &'static str, points: Vec<Point>) -> Curve {
        let first = points.first().map_or(0.0, |p| p.per_op_us);
        let most = points.iter().map(|p| p.per_op_us).fold(0.0, f64::max);
        let growth = if first > 0.0 { round3(most / first) } else { 0.0 };
        Curve { scale_curve: true, curve, unit, points, growth, within_target: growth <= 1.5 }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Counts from 1 to `max`: 1, 3, 10, 30, ... and `max` itself.
pub fn counts(from: u64, max: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut x = from.max(1);
    while x < max {
        v.push(x);
        let next = if v.len() % 2 == 1 { x * 3 } else { x * 10 / 3 };
        x = next.max(x + 1);
    }
    v.push(max.max(from));
    v
}

/// This process's resident set, bytes (0 where /proc is not there).
pub fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn point(curve: &'static str, x: u64, us: f64, per_unit: Option<f64>) -> Point {
    Point {
        scale: true,
        curve,
        x,
        per_op_us: round3(us),
        ops_per_s: if us > 0.0 { (1e6 / us).round() } else { 0.0 },
        bytes_per_unit: per_unit.map(f64::round),
    }
}

/// The median of `rounds` timings of `n` calls of `op`, per call, microseconds.
async fn per_op<F, Fut>(n: u64, mut op: F) -> Result<f64>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    op(0).await?; // warm-up
    let mut times = Vec::new();
    let rounds = 5;
    let each = n.div_ceil(rounds).max(1);
    for r in 0..rounds {
        let t = Instant::now();
        for i in 0..each {
            op(r * each + i).await?;
        }
        times.push(t.elapsed().as_secs_f64() * 1e6 / each as f64);
    }
    Ok(crate::measure::median(&times))
}

async fn tcp_engine() -> Result<Engine> {
    Ok(Engine::builder().backend(make_backend("tcp", 2)?).start().await?)
}

/// Memory regions are registered over: one buffer per engine, cut into `OP`-byte regions.
struct Slab {
    regions: Vec<Region>,
    buf: Vec<u8>,
}

impl Slab {
    fn new(max: u64) -> Slab {
        Slab { regions: Vec::new(), buf: vec![1u8; (max * OP) as usize] }
    }

    /// Registers regions on `e` until there are `n`.
    async fn grow(&mut self, e: &Engine, n: u64, perms: Permissions) -> Result<()> {
        while (self.regions.len() as u64) < n {
            let at = self.regions.len() * OP as usize;
            let ptr = self.buf[at..].as_mut_ptr();
            // SAFETY: `ptr` is `OP` bytes of `buf`, which this slab owns and drops only after
            // its regions (`Drop` below); nothing else touches those bytes meanwhile.
            let r = unsafe { e.register_raw(ptr, OP, MemoryKind::Host, perms) }.await?;
            self.regions.push(r);
        }
        Ok(())
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        self.regions.clear(); // deregistered before the memory goes
    }
}

/// Per-op time against regions registered on each engine.
pub async fn regions(l: &Limits) -> Result<Curve> {
    let (a, b) = (tcp_engine().await?, tcp_engine().await?);
    let (mut mine, mut theirs) = (Slab::new(l.regions), Slab::new(l.regions));
    let s = a.connect(b.local_addr()).await?;
    let mut points = Vec::new();
    let (mut had, mut mem) = (0u64, rss());
    for x in counts(1, l.regions) {
        mine.grow(&a, x, Permissions::NONE).await?;
        theirs.grow(&b, x, Permissions::READ_WRITE).await?;
        let now = rss();
        let per =
            (x > had && had > 0).then(|| now.saturating_sub(mem) as f64 / (2 * (x - had)) as f64);
        (had, mem) = (x, now);
        let src = &mine.regions[0];
        let dst = theirs.regions[(x / 2) as usize].remote();
        let us = per_op(l.ops, |_| {
            let op = TransferOp::write(src, 0, &dst, 0, OP);
            let s = &s;
            async move { s.transfer(op).await.map(drop).map_err(Into::into) }
        })
        .await?;
        points.push(point("regions", x, us, per));
    }
    drop((mine, theirs));
    a.shutdown().await;
    b.shutdown().await;
    Ok(Curve::new("regions", "regions registered on each engine", points))
}

/// Per-op time against the peers a client is connected to.
pub async fn peers(l: &Limits) -> Result<Curve> {
    let a = tcp_engine().await?;
    let src = a.alloc(OP, Permissions::NONE).await?;
    let mut peers: Vec<(Engine, Region, tensorwire_core::Session)> = Vec::new();
    let mut points = Vec::new();
    let (mut had, mut mem) = (0u64, rss());
    for x in counts(1, l.peers) {
        while (peers.len() as u64) < x {
            let b = tcp_engine().await?;
            let r = b.alloc(OP, Permissions::READ_WRITE).await?;
            let s = a.connect(b.local_addr()).await?;
            s.transfer(TransferOp::write(&src, 0, &r.remote(), 0, OP)).await?; // opens the streams
            peers.push((b, r, s));
        }
        let now = rss();
        let per = (x > had && had > 0).then(|| now.saturating_sub(mem) as f64 / (x - had) as f64);
        (had, mem) = (x, now);
        let targets: Vec<_> = peers.iter().map(|(_, r, s)| (r.remote(), s.clone())).collect();
        let us = per_op(l.ops, |i| {
            let (dst, s) = &targets[(i % x) as usize];
            let op = TransferOp::write(&src, 0, dst, 0, OP);
            async move { s.transfer(op).await.map(drop).map_err(Into::into) }
        })
        .await?;
        points.push(point("peers", x, us, per));
    }
    for (b, r, _) in peers {
        drop(r);
        b.shutdown().await;
    }
    a.shutdown().await;
    Ok(Curve::new(
        "peers",
        "peer engines connected (memory: per peer engine and its connection)",
        points,
    ))
}

/// Per-op time against ops per submit.
pub async fn batch(l: &Limits) -> Result<Curve> {
    let (a, b) = (tcp_engine().await?, tcp_engine().await?);
    let src = a.alloc(l.batch * OP, Permissions::NONE).await?;
    let dst = b.alloc(l.batch * OP, Permissions::READ_WRITE).await?;
    let s = a.connect(b.local_addr()).await?;
    let remote = dst.remote();
    let mut points = Vec::new();
    for x in counts(1, l.batch) {
        let batches = l.ops.div_ceil(x).max(3);
        let us = per_op(batches, |_| {
            let ops =
                (0..x).map(|i| TransferOp::write(&src, i * OP, &remote, i * OP, OP)).collect();
            submit_checked(&s, ops, "tcp")
        })
        .await?;
        points.push(point("batch", x, us / x as f64, None));
    }
    a.shutdown().await;
    b.shutdown().await;
    Ok(Curve::new("batch", "4 KiB ops per submit", points))
}

/// Per-op time (put_from + get_into + remove of a fresh key) against 64 KiB objects held, and
/// against 4 KiB ones (as many as the 1,000,000 fit this machine only that small).
pub async fn objects(l: &Limits) -> Result<(Curve, Curve)> {
    Ok((
        objects_of(l, OBJECT, l.objects, "store objects").await?,
        objects_of(l, OP, l.small_objects, "small store objects").await?,
    ))
}

async fn objects_of(l: &Limits, size: u64, max: u64, curve: &'static str) -> Result<Curve> {
    let e = tcp_engine().await?;
    let cfg = StoreConfig { capacity: (max + 64) * size + (64 << 20), ..StoreConfig::default() };
    let store: Arc<dyn Store> = EmbeddedStore::new(&e, cfg).await?;
    let src = e.alloc(size, Permissions::NONE).await?;
    src.write_bytes(0, &vec![5u8; size as usize])?;
    let dst = e.alloc(size, Permissions::NONE).await?;
    let meta = TensorMeta::contiguous(DType::U8, &[size]);
    let slice = src.slice(0, size)?;
    let mut points = Vec::new();
    let mut had = 0u64;
    for x in counts(1000, max) {
        while had < x {
            let key = format!("held-{had}");
            store.put_from(key.as_bytes(), &meta, &slice, Retention::Normal).await?;
            had += 1;
        }
        let us = per_op(l.ops, |i| {
            let key = format!("probe-{x}-{i}");
            let (store, meta, slice, dst) = (&store, &meta, &slice, &dst);
            async move {
                store.put_from(key.as_bytes(), meta, slice, Retention::Normal).await?;
                store.get_into(key.as_bytes(), dst, 0).await?;
                store.remove(key.as_bytes()).await?;
                Ok(())
            }
        })
        .await?;
        // No memory figure: the pool's pages dominate RSS and are reused across points.
        points.push(point(curve, x, us, None));
    }
    drop(store);
    e.shutdown().await;
    let unit = if size == OBJECT { "64 KiB objects held" } else { "4 KiB objects held" };
    Ok(Curve::new(curve, unit, points))
}

/// Per-decision time of the scheduler core against its workers (requests in flight: twice the
/// workers) and against requests in flight (1,000 workers).
pub fn scheduler(l: &Limits) -> (Curve, Curve) {
    // The median of three runs: one run's figure swung by up to 1.6x on the shared machine.
    let decide = |workers: u64, in_flight: u64| {
        let runs: Vec<f64> = (0..3)
            .map(|_| orchestrator::run(workers as u32, l.sched_requests, in_flight))
            .map(|f| if f.decisions_per_s > 0.0 { 1e6 / f.decisions_per_s } else { 0.0 })
            .collect();
        crate::measure::median(&runs)
    };
    let by_workers = counts(100, l.workers)
        .into_iter()
        .map(|x| point("workers", x, decide(x, 2 * x), None))
        .collect();
    let by_flight = counts(1000, l.in_flight)
        .into_iter()
        .map(|x| point("requests in flight", x, decide(1000, x), None))
        .collect();
    (
        Curve::new("workers", "scheduler workers (requests in flight: twice as many)", by_workers),
        Curve::new(
            "requests in flight",
            "requests in flight at the scheduler (1,000 workers)",
            by_flight,
        ),
    )
}

/// Per-request time through the service against requests in flight, without the journal and
/// with it.
pub async fn service(l: &Limits) -> Result<(Curve, Curve)> {
    Ok((service_curve(l, false).await?, service_curve(l, true).await?))
}

async fn service_curve(l: &Limits, journal: bool) -> Result<Curve> {
    let name = if journal { "service with journal" } else { "service" };
    let mut points = Vec::new();
    for x in counts(1, l.service_in_flight) {
        let n = (20 * x).clamp(l.service_requests / 10, l.service_requests.max(1));
        let mut times = Vec::new();
        for _ in 0..3 {
            times.push(1e6 / service::run(n, x, journal).await?.per_s());
        }
        points.push(point(name, x, crate::measure::median(&times), None));
    }
    let unit = "requests in flight through the service over TCP (16 worker clients)";
    Ok(Curve::new(name, unit, points))
}

/// Every curve, each reported through `on_point` as its points are measured.
pub async fn all(l: &Limits, on_point: &(dyn Fn(&Point) + Sync)) -> Result<Vec<Curve>> {
    let mut curves = vec![regions(l).await?, peers(l).await?, batch(l).await?];
    let (big, small) = objects(l).await?;
    curves.push(big);
    curves.push(small);
    let (w, f) = scheduler(l);
    curves.push(w);
    curves.push(f);
    let (plain, journal) = service(l).await?;
    curves.push(plain);
    curves.push(journal);
    for c in &curves {
        c.points.iter().for_each(on_point);
    }
    Ok(curves)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_run_from_the_first_to_the_largest() {
        assert_eq!(counts(1, 100), vec![1, 3, 10, 30, 100]);
        assert_eq!(counts(1000, 100_000), vec![1000, 3000, 10_000, 30_000, 100_000]);
        assert_eq!(counts(1, 64), vec![1, 3, 10, 30, 64]);
        assert_eq!(counts(5, 5), vec![5]);
        assert_eq!(counts(1, 1), vec![1]);
    }

    #[test]
    fn growth_is_the_worst_point_over_the_first() {
        let c = Curve::new(
            "t",
            "t",
            vec![point("t", 1, 2.0, None), point("t", 10, 3.5, None), point("t", 100, 2.5, None)],
        );
        assert_eq!(c.growth, 1.75);
        assert!(!c.within_target);
        assert_eq!(c.points[1].ops_per_s, 285_714.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tiny_scale_run_measures_every_curve() {
        let l = Limits {
            regions: 10,
            peers: 2,
            batch: 4,
            objects: 1001,
            small_objects: 1002,
            workers: 100,
            in_flight: 1000,
            sched_requests: 100,
            service_in_flight: 4,
            service_requests: 40,
            ops: 10,
        };
        let curves = all(&l, &|_| {}).await.unwrap();
        let names: Vec<_> = curves.iter().map(|c| c.curve).collect();
        assert_eq!(
            names,
            [
                "regions",
                "peers",
                "batch",
                "store objects",
                "small store objects",
                "workers",
                "requests in flight",
                "service",
                "service with journal"
            ]
        );
        for c in &curves {
            assert!(
                c.points.iter().all(|p| p.per_op_us > 0.0),
                "{}: a point measured nothing",
                c.curve
            );
            assert_eq!(
                c.points.last().unwrap().x,
                match c.curve {
                    "regions" => 10,
                    "peers" => 2,
                    "batch" => 4,
                    "store objects" => 1001,
                    "small store objects" => 1002,
                    "workers" => 100,
                    "service" | "service with journal" => 4,
                    _ => 1000,
                }
            );
        }
    }
}
