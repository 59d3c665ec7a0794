//! The clock of the loops that drive a [`Driver`](crate::Driver) over tokio (the library
//! orchestrator and the service): the driver itself takes the time as an argument and does no
//! IO, so that the simulator can drive it in virtual time.

use std::time::{Duration, Instant};

use tokio::sync::mpsc;

/// The clock of a driver loop: time since the loop started, and a tick so the scheduler's timers
/// (heartbeats, aging) run when no event comes.
#[derive(Debug)]
pub(crate) struct Ticker {
    start: Instant,
    tick: tokio::time::Interval,
}

impl Ticker {
    pub(crate) fn new(every: Duration) -> Ticker {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ticker { start: Instant::now(), tick }
    }

    /// The next event (`None` on a tick) with the time, or `None` once every sender is gone.
    pub(crate) async fn next<E>(
        &mut self,
        rx: &mut mpsc::Receiver<E>,
    ) -> Option<(Duration, Option<E>)> {
        let ev = tokio::select! {
            e = rx.recv() => Some(e?),
            _ = self.tick.tick() => None,
        };
        Some((self.start.elapsed(), ev))
    }
}
