//! tensorwire-proto: the wire layer every tensorwire protocol shares. The engine's control
//! channel, the store RPC, the orchestrator service and the rdma control channel all speak
//! [`wire::frame`] frames (magic, version, kind, bounded length), encode their bodies with the
//! bounded [`wire::codec`], open with the same authenticated [`handshake`] (both sides prove the
//! [`auth::ClusterSecret`] over a transcript of both nonces and the protocol's magic), and return
//! errors as [`wire::error`] bodies. [`Error`] is the error of every tensorwire crate.
//!
//! Every decoder here is total: any input gives a value or an error, never a panic (proptests
//! here, cargo-fuzz targets under `fuzz/`).

#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(loom, allow(dead_code, unused_imports, unreachable_pub))]

pub mod error;
pub mod ids;
pub mod wire;

#[cfg(not(loom))]
pub mod accept;
#[cfg(not(loom))]
pub mod admission;
#[cfg(not(loom))]
pub mod auth;
#[cfg(not(loom))]
pub mod discovery;
#[cfg(not(loom))]
mod exposure;
#[cfg(not(loom))]
pub mod handshake;
#[cfg(not(loom))]
pub mod loopback_secret;
#[cfg(not(loom))]
mod secret_file;

pub use error::{Error, Missing, Result};
pub use ids::{AccessKey, EngineId, RegionId};
