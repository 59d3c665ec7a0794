//! The GPU seam: what a GPU crate (`tensorwire-cuda`) implements so the engine can register,
//! pin and copy device memory ([`crate::EngineBuilder::gpu`], [`crate::EngineBuilder::device_copier`]).
//! Nothing here dereferences device memory: the engine reaches it only through these traits.

pub use crate::memory::{DeviceCopier, Gpu};
