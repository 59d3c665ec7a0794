//! The integration tests of `tensorwire-core`, in one test binary: a module per concern.

mod handshake;
mod memory_seam;
mod raw_regions;
