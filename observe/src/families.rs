//! The one table of metric families: every `tensorwire_*` name any crate records, its kind,
//! labels and meaning. A test of this crate finds every name recorded in the workspace's
//! sources here, and every name here in the sources and in the table of docs/book/src/metrics.md.

/// What a family counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (name ends in `_total`).
    Counter,
    /// A level that goes up and down.
    Gauge,
    /// A distribution (seconds: the buckets of [`crate::install`]).
    Histogram,
}

/// One metric family.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// The name, as Prometheus shows it.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// Its labels, comma-separated (empty: none).
    pub labels: &'static str,
    /// Who records it.
    pub recorded_by: &'static str,
    /// What it means (the HELP line).
    pub help: &'static str,
}

const fn f(
    name: &'static str,
    kind: Kind,
    labels: &'static str,
    recorded_by: &'static str,
    help: &'static str,
) -> Family {
    Family { name, kind, labels, recorded_by, help }
}

use Kind::{Counter, Gauge, Histogram};

/// Every family, grouped by the layer that records it.
#[rustfmt::skip]
pub const FAMILIES: &[Family] = &[
    // The transfer engine (any process with an engine).
    f("tensorwire_transfer_ops_total", Counter, "backend,direction", "engine",
      "Transfer ops completed successfully (direction: read or write)."),
    f("tensorwire_transfer_bytes_total", Counter, "backend,direction", "engine",
      "Bytes moved by successful transfer ops."),
    f("tensorwire_transfer_seconds", Histogram, "backend,direction", "engine",
      "Time from a transfer op's submission to its completion."),
    f("tensorwire_transfer_errors_total", Counter, "backend,kind", "engine",
      "Transfer ops that failed, by error kind (timeout, peer_closed, access_denied, checksum, ...)."),
    f("tensorwire_transfers_in_flight", Gauge, "", "engine",
      "Transfer ops submitted and not yet completed."),
    f("tensorwire_connections_total", Counter, "backend", "engine",
      "Connections to peer engines opened (each peer and backend once per engine)."),
    f("tensorwire_registered_regions", Gauge, "", "engine",
      "Memory regions registered with the engine."),
    f("tensorwire_registered_bytes", Gauge, "", "engine", "Bytes of the registered regions."),
    f("tensorwire_staging_bounces_total", Counter, "direction", "engine",
      "Transfers that went through a host staging buffer because the backend cannot reach \
       the device memory directly (read, write: this engine's ops; serve: a peer's op on its \
       device memory)."),
    // The store (a store node, or an embedded store).
    f("tensorwire_store_objects", Gauge, "", "store", "Objects in the store's pool."),
    f("tensorwire_store_bytes", Gauge, "", "store",
      "Bytes of the pool in allocated blocks (objects and pending puts)."),
    f("tensorwire_store_capacity_bytes", Gauge, "", "store", "Size of the store's pool."),
    f("tensorwire_store_pinned_objects", Gauge, "", "store",
      "Objects pinned (never evicted until unpinned)."),
    f("tensorwire_store_spilled_objects", Gauge, "", "store", "Objects in the spill tier."),
    f("tensorwire_store_evictions_total", Counter, "", "store",
      "Objects evicted from the pool (dropped, or written to the spill tier)."),
    f("tensorwire_store_spills_total", Counter, "", "store",
      "Objects written to the spill tier."),
    f("tensorwire_store_spill_bytes_total", Counter, "", "store",
      "Bytes written to the spill tier."),
    f("tensorwire_store_gets_total", Counter, "result", "store",
      "Reads of an object by key (result: hit or miss)."),
    f("tensorwire_store_lease_expiries_total", Counter, "", "store",
      "Objects removed because their time to live ran out before every consumer read them."),
    // The diffusion connector (the worker processes).
    f("tensorwire_handoff_publishes_total", Counter, "kind", "connector",
      "Payloads published (kind: the payload kind, e.g. latent, embedding)."),
    f("tensorwire_handoff_consumes_total", Counter, "kind", "connector",
      "Payloads consumed to the end."),
    f("tensorwire_handoff_bytes_total", Counter, "kind,direction", "connector",
      "Payload bytes published (out) and consumed (in)."),
    f("tensorwire_handoff_seconds", Histogram, "kind", "connector",
      "Time from the start of a consume to its last byte landing."),
    // The diffusion caches.
    f("tensorwire_cache_hits_total", Counter, "cache", "caches",
      "Lookups that found the entry (cache: embedding, cfg, ...)."),
    f("tensorwire_cache_misses_total", Counter, "cache", "caches",
      "Lookups that did not find the entry (or could not read it)."),
    f("tensorwire_cache_hit_bytes_total", Counter, "cache", "caches",
      "Bytes served from the cache."),
    f("tensorwire_cache_errors_total", Counter, "cache", "caches",
      "Cache reads or writes that failed (counted as misses on read)."),
    // The orchestrator (the process that serves it).
    f("tensorwire_requests_total", Counter, "class,outcome", "orchestrator",
      "Requests ended (class: interactive or batch; outcome: completed or failed)."),
    f("tensorwire_request_seconds", Histogram, "class", "orchestrator",
      "Time from a request's submission to its end."),
    f("tensorwire_ttff_seconds", Histogram, "class", "orchestrator",
      "Time to first frame: from a request's submission to the first output of its decode \
       stage the orchestrator hears of (an announced output, else its result)."),
    f("tensorwire_queue_depth", Gauge, "stage,class", "orchestrator",
      "Items waiting in a stage's queue."),
    f("tensorwire_dispatched_total", Counter, "stage", "orchestrator",
      "Items handed to a worker."),
    f("tensorwire_requeued_total", Counter, "", "orchestrator",
      "Items queued again after a failure or a dead worker."),
    f("tensorwire_preemptions_total", Counter, "", "orchestrator",
      "Yield asks sent to holders of batch jobs for waiting interactive ones."),
    f("tensorwire_credits_in_use", Gauge, "stage", "orchestrator",
      "Worker slots of a stage running an item."),
    f("tensorwire_free_slots", Gauge, "stage", "orchestrator",
      "Worker slots of a stage free for an item."),
    f("tensorwire_workers", Gauge, "stage,state", "orchestrator",
      "Workers joined, per pool (stage) and state (live or draining)."),
    f("tensorwire_switches_total", Counter, "from,to", "orchestrator",
      "Workers told to move from one stage's pool to another's (elastic pools)."),
    f("tensorwire_switch_seconds", Histogram, "stage", "orchestrator",
      "Time a moved worker took to switch (load the stage) before joining its new pool."),
    f("tensorwire_journal_sync_seconds", Histogram, "", "orchestrator",
      "Time to write and sync one batch of journal facts."),
    // Every process that exports.
    f("tensorwire_build_info", Gauge, "version,process", "every process",
      "Always 1; its labels name the version and the kind of process."),
];
