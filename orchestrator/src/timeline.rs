//! Per-request timelines (sans-IO): when a request was submitted, queued at each stage, handed
//! to which worker, when that worker's result (or its first announced output) came back, and
//! when it ended. The times are the orchestrator's clock at each event (a worker's own start and
//! end differ by the network's delay). Kept for every request in flight (about 200 bytes each)
//! and for the last [`KEEP_ENDED`] that ended.

use std::collections::VecDeque;
use std::time::Duration;

use tensorwire_core::{Error, Result};
use tensorwire_proto::wire::codec::{Reader, Writer};

use crate::fasthash::FastMap;
use crate::{Priority, Stage};

/// Ended requests whose timelines are kept.
pub const KEEP_ENDED: usize = 4096;
/// Events kept per request (a request that is retried many times keeps its first ones and its
/// end).
pub const MAX_EVENTS: usize = 64;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// The request arrived.
    Submitted,
    /// Rebuilt from the journal after an orchestrator restart (its earlier events are gone).
    Restored,
    /// An item of the stage joined its queue.
    Queued,
    /// The stage's item went to `worker`.
    Dispatched {
        /// The worker's id.
        worker: u64,
    },
    /// The stage's worker announced an output (e.g. a decoded chunk on its way).
    Announced,
    /// The stage's worker received its input payloads: `bytes` in all, the last of them in
    /// hand `micros` after it started consuming (as the worker measured it).
    Handoff {
        /// Payload bytes received.
        bytes: u64,
        /// Microseconds from the start of the consume to the last byte in hand.
        micros: u64,
    },
    /// The stage's worker reported it done.
    Done,
    /// The stage's worker reported it failed (it may be tried again).
    Failed,
    /// The stage's worker found its input gone (the stage before runs again).
    LostInput,
    /// The stage's worker gave the job back at a step boundary (preempted, or draining).
    Yielded,
    /// The stage's worker left or went silent while it held the item: queued again.
    Requeued,
    /// The request ended.
    Ended {
        /// Completed (or failed).
        ok: bool,
    },
}

/// One event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// The orchestrator's clock (time since it started).
    pub at: Duration,
    /// The stage, for stage events.
    pub stage: Option<Stage>,
    /// What happened.
    pub mark: Mark,
}

/// A request's events, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    /// The request.
    pub request: u64,
    /// Its class.
    pub priority: Priority,
    /// Its events.
    pub events: Vec<Event>,
}

impl Timeline {
    /// From the first event to the end (or to the last event, in flight).
    pub fn span(&self) -> Duration {
        match (self.events.first(), self.events.last()) {
            (Some(a), Some(b)) => b.at.saturating_sub(a.at),
            _ => Duration::ZERO,
        }
    }

    /// Time to first frame: from the first event to the decode stage's first output (announced,
    /// else its result), if it came.
    pub fn ttff(&self) -> Option<Duration> {
        let start = self.events.first()?.at;
        let first = self.events.iter().find(|e| {
            e.stage == Some(Stage::Decode) && matches!(e.mark, Mark::Announced | Mark::Done)
        })?;
        Some(first.at.saturating_sub(start))
    }

    /// One line per event, times relative to the first.
    pub fn render(&self) -> String {
        let start = self.events.first().map_or(Duration::ZERO, |e| e.at);
        let mut s = format!("request {} ({:?})\n", self.request, self.priority);
        for e in &self.events {
            let t = e.at.saturating_sub(start).as_secs_f64() * 1e3;
            let stage = e.stage.map_or(String::new(), |s| format!(" {}", s.name()));
            let what = match e.mark {
                Mark::Submitted => "submitted".to_string(),
                Mark::Restored => "restored from the journal".to_string(),
                Mark::Queued => "queued".to_string(),
                Mark::Dispatched { worker } => format!("dispatched to worker {worker}"),
                Mark::Announced => "announced an output".to_string(),
                Mark::Handoff { bytes, micros } => {
                    format!("received {bytes} bytes of input in {:.2} ms", micros as f64 / 1e3)
                }
                Mark::Done => "done".to_string(),
                Mark::Failed => "failed (to be tried again, or the request fails)".to_string(),
                Mark::LostInput => "lost its input (the stage before runs again)".to_string(),
                Mark::Yielded => "given back at a step boundary".to_string(),
                Mark::Requeued => "its worker left or went silent: queued again".to_string(),
                Mark::Ended { ok: true } => "completed".to_string(),
                Mark::Ended { ok: false } => "failed".to_string(),
            };
            s.push_str(&format!("  {t:>10.1} ms{stage} {what}\n"));
        }
        s
    }
}

impl Timeline {
    /// Appends the wire form.
    pub fn encode(&self, w: &mut Writer) {
        w.u64(self.request);
        self.priority.encode(w);
        w.u32(self.events.len().min(MAX_EVENTS) as u32);
        for e in self.events.iter().take(MAX_EVENTS) {
            let micros = u64::try_from(e.at.as_micros()).unwrap_or(u64::MAX);
            w.u64(micros).u8(e.stage.map_or(u8::MAX, |s| s.index() as u8));
            let (tag, a, b) = match e.mark {
                Mark::Submitted => (0, 0, 0),
                Mark::Restored => (1, 0, 0),
                Mark::Queued => (2, 0, 0),
                Mark::Dispatched { worker } => (3, worker, 0),
                Mark::Announced => (4, 0, 0),
                Mark::Done => (5, 0, 0),
                Mark::Failed => (6, 0, 0),
                Mark::LostInput => (7, 0, 0),
                Mark::Ended { ok: false } => (8, 0, 0),
                Mark::Ended { ok: true } => (9, 0, 0),
                Mark::Handoff { bytes, micros } => (10, bytes, micros),
                Mark::Yielded => (11, 0, 0),
                Mark::Requeued => (12, 0, 0),
            };
            w.u8(tag).u64(a).u64(b);
        }
    }

    /// Reads the wire form; never panics.
    pub fn decode(r: &mut Reader<'_>) -> Result<Timeline> {
        let request = r.u64()?;
        let priority = Priority::decode(r)?;
        let n = r.count(MAX_EVENTS, "timeline events")?;
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            let at = Duration::from_micros(r.u64()?);
            let stage =
                match r.u8()? {
                    u8::MAX => None,
                    t => Some(*Stage::ALL.get(usize::from(t)).ok_or_else(|| {
                        Error::protocol(format!("timeline: unknown stage tag {t}"))
                    })?),
                };
            let (tag, a, b) = (r.u8()?, r.u64()?, r.u64()?);
            let mark = match tag {
                0 => Mark::Submitted,
                1 => Mark::Restored,
                2 => Mark::Queued,
                3 => Mark::Dispatched { worker: a },
                10 => Mark::Handoff { bytes: a, micros: b },
                11 => Mark::Yielded,
                12 => Mark::Requeued,
                4 => Mark::Announced,
                5 => Mark::Done,
                6 => Mark::Failed,
                7 => Mark::LostInput,
                8 => Mark::Ended { ok: false },
                9 => Mark::Ended { ok: true },
                t => return Err(Error::protocol(format!("timeline: unknown event {t}"))),
            };
            events.push(Event { at, stage, mark });
        }
        Ok(Timeline { request, priority, events })
    }
}

/// The timelines of the requests in flight and of the last ended ones.
#[derive(Debug, Default)]
pub struct Timelines {
    live: FastMap<u64, Timeline>,
    /// Per request in flight, its `tracing` span (`request`, with the id as a field): every
    /// event is recorded in it, and it closes when the request ends. Disabled (and free) where
    /// no subscriber wants it.
    spans: FastMap<u64, tracing::Span>,
    ended: VecDeque<u64>,
    ended_by: FastMap<u64, Timeline>,
}

impl Timelines {
    /// Starts `request`'s timeline with `first` (submitted, or restored).
    pub fn begin(&mut self, request: u64, priority: Priority, first: Mark, now: Duration) {
        let events = vec![Event { at: now, stage: None, mark: first }];
        self.live.insert(request, Timeline { request, priority, events });
        let span = tracing::info_span!("request", request, class = ?priority);
        if !span.is_disabled() {
            span.in_scope(|| tracing::debug!(mark = ?first, "request event"));
            self.spans.insert(request, span);
        }
    }

    /// Adds an event of a request in flight (ignored for an unknown one).
    pub fn mark(&mut self, request: u64, stage: Stage, mark: Mark, now: Duration) {
        if let Some(t) = self.live.get_mut(&request) {
            if t.events.len() < MAX_EVENTS - 1 {
                t.events.push(Event { at: now, stage: Some(stage), mark });
            }
        }
        if let Some(span) = self.spans.get(&request) {
            span.in_scope(|| tracing::debug!(stage = stage.name(), mark = ?mark, "request event"));
        }
    }

    /// Ends `request`'s timeline; returns it (kept among the last ended).
    pub fn end(&mut self, request: u64, ok: bool, now: Duration) -> Option<&Timeline> {
        if let Some(span) = self.spans.remove(&request) {
            span.in_scope(|| tracing::debug!(ok = ok, "request ended")); // and the span closes
        }
        let mut t = self.live.remove(&request)?;
        t.events.push(Event { at: now, stage: None, mark: Mark::Ended { ok } });
        if self.ended.len() >= KEEP_ENDED {
            if let Some(old) = self.ended.pop_front() {
                self.ended_by.remove(&old);
            }
        }
        self.ended.push_back(request);
        self.ended_by.insert(request, t);
        self.ended_by.get(&request)
    }

    /// The timeline of `request`, in flight or among the last ended.
    pub fn get(&self, request: u64) -> Option<&Timeline> {
        self.live.get(&request).or_else(|| self.ended_by.get(&request))
    }

    /// The kept ended timelines, oldest first.
    pub fn ended(&self) -> impl Iterator<Item = &Timeline> {
        self.ended.iter().filter_map(|r| self.ended_by.get(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_orders_events_and_finds_its_first_frame() {
        let ms = Duration::from_millis;
        let mut t = Timelines::default();
        t.begin(7, Priority::Interactive, Mark::Submitted, ms(10));
        t.mark(7, Stage::Encode, Mark::Queued, ms(10));
        t.mark(7, Stage::Encode, Mark::Dispatched { worker: 1 }, ms(11));
        t.mark(7, Stage::Encode, Mark::Done, ms(20));
        t.mark(7, Stage::Decode, Mark::Dispatched { worker: 3 }, ms(40));
        assert_eq!(t.get(7).unwrap().ttff(), None, "no decode output yet");
        t.mark(7, Stage::Decode, Mark::Announced, ms(45));
        t.mark(7, Stage::Decode, Mark::Done, ms(60));
        t.mark(8, Stage::Encode, Mark::Queued, ms(10)); // unknown: ignored
        assert!(t.get(8).is_none());
        let done = t.end(7, true, ms(61)).unwrap();
        assert_eq!(done.ttff(), Some(ms(35)), "the announced output, before the result");
        assert_eq!(done.span(), ms(51));
        assert_eq!(done.events.len(), 8);
        assert!(done.render().contains("dispatched to worker 3"));
        assert!(t.end(7, true, ms(62)).is_none(), "ends once");
    }

    #[test]
    fn the_wire_form_round_trips_and_its_decoder_is_total() {
        let ms = Duration::from_millis;
        let mut t = Timelines::default();
        t.begin(9, Priority::Batch, Mark::Submitted, ms(1));
        let handoff = Mark::Handoff { bytes: 65536, micros: 1500 };
        for (i, m) in
            [Mark::Queued, Mark::Dispatched { worker: 4 }, handoff, Mark::Announced, Mark::Done]
                .into_iter()
                .enumerate()
        {
            t.mark(9, Stage::Decode, m, ms(2 + i as u64));
        }
        t.mark(9, Stage::Encode, Mark::Failed, ms(8));
        t.mark(9, Stage::Encode, Mark::LostInput, ms(9));
        t.mark(9, Stage::Denoise, Mark::Yielded, ms(9));
        t.mark(9, Stage::Denoise, Mark::Requeued, ms(9));
        let one = t.end(9, true, ms(10)).unwrap().clone();
        assert!(one.render().contains("received 65536 bytes of input in 1.50 ms"));
        let mut w = Writer::new();
        one.encode(&mut w);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes, "timeline");
        assert_eq!(Timeline::decode(&mut r).unwrap(), one);
        r.finish().unwrap();
        for cut in 0..bytes.len() {
            let mut r = Reader::new(&bytes[..cut], "timeline");
            assert!(Timeline::decode(&mut r).and_then(|_| r.finish()).is_err(), "cut at {cut}");
        }
        let mut bad = bytes.clone();
        bad[8 + 1 + 4 + 8] = 7; // the first event's stage tag
        assert!(Timeline::decode(&mut Reader::new(&bad, "timeline")).is_err());
    }

    /// Collects what a `fmt` subscriber writes.
    #[derive(Clone, Default)]
    struct Log(std::sync::Arc<parking_lot::Mutex<Vec<u8>>>);

    impl std::io::Write for Log {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn each_request_is_a_tracing_span_holding_its_events() {
        // A callsite's interest is computed once, when a thread first hits it: a test on another
        // thread (with no subscriber) that started registering a callsite before this test's
        // subscriber existed, and finished after the rebuild below, leaves it at "never", and
        // this test's events vanish (seen alone in 5 of 30 runs). Registration happens once per
        // callsite, so a second try, after another rebuild, sees every callsite registered; a
        // bug that emits nothing fails every try.
        let mut text = String::new();
        for _ in 0..3 {
            text = request_span_log();
            if text.lines().count() == 3 {
                break;
            }
        }
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines.iter().all(|l| l.contains("request{request=7 class=Interactive}")), "{text}");
        assert!(lines[1].contains("stage=\"encode\" mark=Dispatched { worker: 3 }"), "{text}");
        assert!(lines[2].contains("request ended ok=true"), "{text}");
    }

    /// What a DEBUG subscriber logs of one request's timeline.
    fn request_span_log() -> String {
        let log = Log::default();
        let l = log.clone();
        let sub = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || l.clone())
            .finish();
        tracing::subscriber::with_default(sub, || {
            // Tests on other threads, with no subscriber, may have cached "never" for these
            // callsites: ask again with this one in place.
            tracing::callsite::rebuild_interest_cache();
            let mut t = Timelines::default();
            t.begin(7, Priority::Interactive, Mark::Submitted, Duration::ZERO);
            t.mark(7, Stage::Encode, Mark::Dispatched { worker: 3 }, Duration::ZERO);
            t.end(7, true, Duration::ZERO);
            t.mark(7, Stage::Encode, Mark::Done, Duration::ZERO); // ended: no span any more
        });
        String::from_utf8(log.0.lock().clone()).unwrap()
    }

    #[test]
    fn memory_is_bounded_per_request_and_in_ended_requests() {
        let mut t = Timelines::default();
        t.begin(1, Priority::Batch, Mark::Submitted, Duration::ZERO);
        for i in 0..1000 {
            t.mark(1, Stage::Denoise, Mark::Queued, Duration::from_millis(i));
        }
        let one = t.end(1, false, Duration::from_secs(2)).unwrap();
        assert_eq!(one.events.len(), MAX_EVENTS);
        assert_eq!(one.events.last().unwrap().mark, Mark::Ended { ok: false }, "the end is kept");
        for r in 2..(KEEP_ENDED as u64 + 10) {
            t.begin(r, Priority::Batch, Mark::Submitted, Duration::ZERO);
            t.end(r, true, Duration::ZERO);
        }
        assert_eq!(t.ended().count(), KEEP_ENDED);
        assert!(t.get(1).is_none(), "the oldest went");
    }
}
