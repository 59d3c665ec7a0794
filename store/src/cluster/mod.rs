//! The cluster store: objects placed over several store nodes, `replicas` copies each, read
//! from any live replica, and repaired when a node dies or joins.
//!
//! - [`placement`]: rendezvous hashing of a key over node ids (every client agrees, with no
//!   coordination; a node that leaves moves only its own keys).
//! - [`plan`]: the sans-IO repair planner (membership and holdings in, copies and deletions
//!   out), with property tests: no object loses its last replica, plans converge.
//! - [`ClusterStore`]: the [`crate::Store`] API over the nodes, and [`ClusterStore::repair`]
//!   (one round) with [`spawn_repair`] (rounds in the background).
//!
//! What holds: a put succeeds once its write quorum of replicas holds the object (all of them
//! by default); a read succeeds while any replica is reachable; a lease's consumer count is
//! kept on every replica and each report reaches every live one, so one report counts once
//! per object; a pinned object is pinned on every replica, so eviction never takes its last.
//! What does not: objects on a node that dies with no other replica are gone; a node that
//! comes back empty is refilled by the repair, not at once; placement assumes the clients
//! agree on the membership (between a change and its propagation, a read may try a few more
//! nodes).

mod client;
mod member;
pub mod placement;
pub mod plan;
mod repair;

pub use client::{ClusterConfig, ClusterStore};
pub use member::{Dial, Member, RemoteDial};
pub use placement::NodeId;
pub use repair::{RepairConfig, RepairReport, spawn_repair};
