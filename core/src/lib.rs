//! tensorwire-core: the transfer engine of tensorwire.
//!
//! An [`Engine`] (one per process) owns registered memory ([`Region`]), plugin [`backend::Backend`]s, a control
//! endpoint for the P2P handshake, and peer [`Session`]s. Transfers are batched READs and WRITEs
//! between a local region and a peer's region ([`TransferOp`]), each completing on its own
//! ([`TransferHandle`]). The chunk API splits a tensor ([`TensorMeta`]) into a [`ChunkPlan`]; a
//! [`ChunkSender`] sends chunk i as soon as it is ready and the consumer's [`ChunkStream`] yields each
//! chunk as it lands. [`backend::MemBackend`] is the in-process reference backend.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use tensorwire_core::{ChunkPlan, DType, Engine, backend::MemBackend, Permissions, TensorMeta};
//!
//! let producer = Engine::builder().backend(MemBackend::new()).start().await?;
//! let consumer = Engine::builder().backend(MemBackend::new()).start().await?;
//!
//! // A [C=2, T=4, H=3, W=3] bf16 latent, chunked along T into 2 temporal chunks.
//! let meta = TensorMeta::contiguous(DType::BF16, &[2, 4, 3, 3]);
//! let bytes = meta.nbytes()?;
//! let src = producer.alloc(bytes, Permissions::NONE).await?;
//! src.write_bytes(0, &vec![7u8; bytes as usize])?;
//! let dst = consumer.alloc(bytes, Permissions::WRITE).await?;
//!
//! let mut stream = consumer.expect_chunks(ChunkPlan::new(&meta, 1, 2)?, &dst, 0)?;
//! let session = producer.connect(consumer.local_addr()).await?;
//! let sender = session.chunk_sender(
//!     stream.transfer_id(), ChunkPlan::new(&meta, 1, 2)?, &src, 0, &dst.remote(), 0)?;
//! sender.mark_ready(1)?;
//! sender.mark_ready(0)?;
//! let mut landed = 0;
//! while let Some(chunk) = stream.next().await? {
//!     assert_eq!(chunk.ranges.len(), 2); // one range per channel
//!     landed += 1;
//! }
//! sender.finish().await?;
//! assert_eq!(landed, 2);
//! assert_eq!(dst.to_vec(0, bytes)?, vec![7u8; bytes as usize]);
//! # Ok::<(), tensorwire_core::Error>(()) }).unwrap();
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
// Under `--cfg loom` only the sans-IO pieces and shared primitives are built (for the loom models).
#![cfg_attr(loom, allow(dead_code, unused_imports, unreachable_pub))]

mod sync;

mod cancel;
mod chunk;
mod dtype;
mod inflight;
mod memory;
mod tensor;
mod wire;

#[cfg(not(loom))]
pub mod backend;
#[cfg(not(loom))]
pub mod block;
#[cfg(not(loom))]
mod bounce;
#[cfg(not(loom))]
mod completion;
#[cfg(not(loom))]
mod copy;
#[cfg(not(loom))]
mod engine;
mod fence;
#[cfg(not(loom))]
pub mod gpu;
#[cfg(not(loom))]
pub mod linger;
#[cfg(not(loom))]
mod region;
#[cfg(not(loom))]
mod tasks;

pub use chunk::{ByteRange, Chunk, ChunkPlan, ChunkTracker, LandedChunk, MAX_RANGES};
pub use dtype::{DType, DlDataType};
// The shared wire layer, named as core's own modules inside core.
pub use memory::{MemoryKind, MemoryKinds};
pub use tensor::{DlTensorFields, MAX_RANK, TensorMeta};
pub use tensorwire_proto::{AccessKey, EngineId, Error, Missing, RegionId, Result};
#[cfg(not(loom))]
use tensorwire_proto::{auth, handshake};
use tensorwire_proto::{error, ids};

#[cfg(not(loom))]
pub use engine::{
    ChunkSender, ChunkStream, Engine, EngineBuilder, EngineConfig, EngineStats, Handled,
    Notification, NotificationHandler, PreparedTransfer, Session, TransferHandle, TransferOp,
    TransferReport,
};
#[cfg(not(loom))]
pub use region::{MemSlice, Permissions, Region, RemoteRegion};
#[cfg(not(loom))]
pub use tensor::row_major_strides;
#[cfg(not(loom))]
pub use tensorwire_proto::auth::ClusterSecret;
#[cfg(not(loom))]
pub use wire::descriptor::EngineDescriptor;
