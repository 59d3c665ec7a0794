//! The connector's handoff logic as plain state machines, apart from IO (the quinn-proto shape):
//! events in, actions out, time passed in. [`Publisher`] is the producer side of every payload a
//! connector holds; [`Fetch`] is one consumer's progress through a p2p payload. The connector
//! drives them with its engine, its store and its notification stream; the property tests in
//! `tests/it/handoff_state.rs` drive them with random event orders.

mod fetch;
mod publish;

pub use fetch::{Fetch, FetchStep, Next};
pub use publish::{Action, Publisher};
