//! Wire formats: versioned, length-prefixed, bounded frames decoded by pure functions that never
//! panic on any input.

pub mod codec;
pub mod envelope;
pub mod error;
pub mod frame;
#[cfg(not(loom))]
pub mod handshake;
