//! `tensorwire-store`: an object pool of registered memory that decouples producer and consumer
//! lifetimes. A producer puts its output and frees its buffer at once; a consumer gets it later
//! (and can get it again if it failed, since the data is still there).
//!
//! - [`Store`]: put / put_from / get / get_into / exists / remove / pin / unpin, plus batch forms.
//!   Objects carry a [`tensorwire_core::TensorMeta`] and a length; keys are 1..=256 bytes.
//! - [`EmbeddedStore`]: the pool lives in this process, registered with the local engine. A
//!   best-fit extent allocator with coalescing places objects; above the high watermark, unpinned
//!   objects are evicted in LRU order down to the low watermark (`Soft` objects after every
//!   `Normal` one, `Pinned` ones and objects being read never); evicted objects go to a file spill
//!   tier when one is configured, and come back on demand.
//! - [`StoreNode`] serves an embedded store to remote engines and [`RemoteStore`] is the client: a
//!   remote put reserves pool space on the node, writes the bytes straight into the node's pool
//!   with an engine WRITE, then commits; a remote get opens the object, READs it straight from the
//!   pool, then closes. Uncommitted puts and unclosed reads expire, so a client that dies leaks
//!   nothing.

//! - `testing` (feature `testing`): the store suite, written once and run against any [`Store`].

pub mod alloc;
mod api;
pub mod cluster;
mod embedded;
mod error;
mod node;
mod remote;
pub mod rpc;
mod spill;
mod state;
#[cfg(feature = "testing")]
pub mod testing;
mod uring;

pub use api::{
    GetInto, MAX_KEY, ObjectInfo, PutFrom, Retention, Store, StoreStats, check_key, check_meta,
};
pub use cluster::{ClusterConfig, ClusterStore};
pub use embedded::{EmbeddedStore, PendingPut, StoreConfig};
pub use error::{Result, StoreError, StoreKey};
pub use node::StoreNode;
pub use remote::RemoteStore;
