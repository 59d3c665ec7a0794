//! The engine's own wire formats (its descriptor), beside the shared ones of `tensorwire-proto`,
//! named here as core's own modules.

#[cfg(not(loom))]
pub(crate) mod descriptor;
pub(crate) use tensorwire_proto::wire::{codec, envelope, error, frame};
