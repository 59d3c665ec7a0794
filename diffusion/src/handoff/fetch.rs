//! One consumer's progress through a chunked p2p payload: which chunks were announced, which reads
//! are in flight (oldest first, at most `window`), what was handed out, and when to report. The IO
//! layer submits the reads it asks for, tells it when the oldest one landed (with the bytes'
//! checksum when the producer sent one), and forwards the producer's messages.

use std::collections::VecDeque;

use crate::control::Control;
use crate::error::ConnectorError;

/// What the IO layer does next for a fetch.
#[derive(Debug)]
pub enum FetchStep {
    /// Submit the reads of chunk `index`.
    Read(u32),
    /// Chunk `index` landed and checked: hand its view to the caller.
    Yield(u32),
    /// Every chunk was handed out: tell the producer the payload was consumed.
    Report,
    /// The fetch failed; nothing more happens.
    Fail(ConnectorError),
}

/// What a fetch waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// A message from the producer (nothing is in flight).
    Message,
    /// The oldest read in flight, chunk `index`; with `or_message`, a producer message that is
    /// already there goes first (more reads may start while this one lands).
    Landing {
        /// The chunk.
        index: u32,
        /// Whether there is room to start more reads.
        or_message: bool,
    },
    /// Finished or failed.
    Done,
}

/// The state of one consume of a p2p payload.
#[derive(Debug)]
pub struct Fetch {
    payload: u64,
    window: usize,
    announced: Vec<bool>,
    crc: Vec<Option<u32>>,
    /// Announced, not yet read (the window was full).
    queued: VecDeque<u32>,
    /// Reads in flight, oldest first.
    flight: VecDeque<u32>,
    left: usize,
    over: bool,
}

impl Fetch {
    /// A fetch of `payload` in `chunks` chunks with at most `window` chunks' reads in flight.
    pub fn new(payload: u64, chunks: u32, window: usize) -> Fetch {
        let n = chunks as usize;
        Fetch {
            payload,
            window: window.max(1),
            announced: vec![false; n],
            crc: vec![None; n],
            queued: VecDeque::new(),
            flight: VecDeque::new(),
            left: n,
            over: n == 0,
        }
    }

    /// What to wait for.
    pub fn next(&self) -> Next {
        match self.flight.front() {
            _ if self.over => Next::Done,
            Some(&index) => Next::Landing { index, or_message: self.flight.len() < self.window },
            None => Next::Message,
        }
    }

    /// Whether the producer sent a checksum for chunk `index` (the IO layer then computes the
    /// landed bytes' and passes it to [`Fetch::on_landed`]).
    pub fn wants_crc(&self, index: u32) -> bool {
        self.crc.get(index as usize).is_some_and(Option::is_some)
    }

    fn fail(&mut self, e: ConnectorError) -> Vec<FetchStep> {
        self.over = true;
        vec![FetchStep::Fail(e)]
    }

    /// A message from the producer about this payload.
    pub fn on_message(&mut self, c: &Control) -> Vec<FetchStep> {
        if self.over {
            return Vec::new();
        }
        match *c {
            Control::Gone { why, .. } => self.fail(why.error(self.payload)),
            Control::Ready { index, crc, .. } => {
                let i = index as usize;
                if i >= self.announced.len() {
                    let e = tensorwire_core::Error::protocol(format!(
                        "producer announced chunk {index} of a {}-chunk payload",
                        self.announced.len()
                    ));
                    return self.fail(ConnectorError::Transport(e));
                }
                if self.announced[i] {
                    return Vec::new(); // a repeat (e.g. a second subscription's replay)
                }
                self.announced[i] = true;
                self.crc[i] = crc;
                self.queued.push_back(index);
                self.refill()
            }
            Control::Subscribe { .. } | Control::Done { .. } => Vec::new(),
        }
    }

    fn refill(&mut self) -> Vec<FetchStep> {
        let mut steps = Vec::new();
        while self.flight.len() < self.window {
            let Some(i) = self.queued.pop_front() else { break };
            self.flight.push_back(i);
            steps.push(FetchStep::Read(i));
        }
        steps
    }

    /// The reads of the oldest chunk in flight, `index`, completed; `actual` is the landed
    /// bytes' checksum when [`Fetch::wants_crc`].
    pub fn on_landed(&mut self, index: u32, actual: Option<u32>) -> Vec<FetchStep> {
        if self.over {
            return Vec::new();
        }
        if self.flight.front() != Some(&index) {
            let e = format!("chunk {index} landed out of order ({:?} in flight)", self.flight);
            return self.fail(ConnectorError::Internal(e));
        }
        self.flight.pop_front();
        match (self.crc[index as usize], actual) {
            (Some(expected), Some(actual)) if expected != actual => {
                let what = format!("chunk {index} of payload {}", self.payload);
                return self.fail(ConnectorError::Checksum { what, expected, actual });
            }
            (Some(_), None) => {
                let e = format!("chunk {index} landed without the checksum it needs");
                return self.fail(ConnectorError::Internal(e));
            }
            _ => {}
        }
        let mut steps = vec![FetchStep::Yield(index)];
        self.left -= 1;
        steps.extend(self.refill());
        if self.left == 0 {
            self.over = true;
            steps.push(FetchStep::Report);
        }
        steps
    }
}
