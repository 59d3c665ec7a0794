//! Wire formats: versioned, length-prefixed, bounded frames decoded by pure functions that never
//! panic on any input (proptest here, cargo-fuzz targets under `fuzz/`).

pub mod codec;
#[cfg(not(loom))]
pub mod descriptor;
pub mod envelope;
pub mod error;
pub mod frame;
#[cfg(not(loom))]
pub mod handshake;
