//! Everything a backend author needs besides the trait, in one place:
//!
//! - completions: [`spawn_cancellable`] (an op run as a task whose completion cancels it on
//!   drop), [`gated`] (a completion resolved from the backend's own I/O tasks), [`ready`],
//!   [`notice_beside`] (a batch's completions whose first also waits for a notice sent beside);
//! - [`CancelGate`]: "no byte lands after the completion's drop returns", for CPU copies;
//! - [`gated_copy`]: the segmented CPU copy of memory-to-memory backends ([`gated_copy_with`]
//!   for another copier, [`copy_bytes`] for one CPU copy);
//! - [`Serving`]: a backend's own listener, engine host, tasks and shutdown flag, and
//!   [`WeakList`] for the connections it fails at shutdown; [`TaskSet`] for other task sets;
//! - [`ShareableMemory`] (on [`super::RegionInfo::shareable`]) and [`DetachedMemory`]
//!   (from `MemSlice::detach`): memory as a same-host backend or a NIC keeps it;
//! - wire helpers: the bounded [`Reader`] / [`Writer`] codec, the shared [`Framing`] checks for a
//!   data header's magic, version and length, and [`encode_error`] / [`decode_error`] to send an
//!   inbound op's refusal back to its initiator as the same [`crate::Error`];
//! - [`lock`]: a std mutex's guard, recovered from poisoning;
//! - bounds: [`MAX_NOTIFY_WIRE`] (largest message `notify` carries), [`MAX_ERROR_BYTES`],
//!   [`MAX_BLOB_BYTES`].

pub use super::serving::{Serving, WeakList};
pub use crate::bounce::{BOUNCE_BYTES, Bounce, copy_blocking};
pub use crate::cancel::CancelGate;
pub use crate::completion::{
    CompletionSender, gated, notice_beside, ready, spawn_cancellable, spawn_in_order,
};
pub use crate::copy::{Copied, SEGMENT, by_segments, copy_bytes, gated_copy, gated_copy_with};
pub use crate::memory::ShareableMemory;
pub use crate::region::{DetachedMemory, MAX_BLOB_BYTES};
pub use crate::tasks::TaskSet;
pub use crate::wire::codec::{Reader, Writer};
pub use crate::wire::envelope::MAX_NOTIFY_WIRE;
pub use crate::wire::error::{MAX_ERROR_BYTES, decode_error, encode_error};
pub use crate::wire::frame::Framing;

/// Locks a std mutex, recovering the guard if a panicking thread poisoned it: for state whose
/// critical sections leave it consistent across a panic (single assignments, inserts, removals).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
