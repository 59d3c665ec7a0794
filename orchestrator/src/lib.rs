//! `tensorwire-orchestrator`: queue-based orchestration of a disaggregated diffusion pipeline.
//!
//! - [`Stage`] (the pipeline's stages, written once) and [`QueueMessage`] (a request at a stage
//!   with its input payload references, priority, deadline, affinity and attempt).
//! - [`sched`]: the scheduler core, sans-IO (plain state, time passed in): per-stage queues
//!   (encode and decode are work queues, denoise an admission queue), priorities with aging,
//!   credits with downstream admission, affinity policies, heartbeats and failure re-queue.
//! - [`Driver`]: the scheduler with the bookkeeping every mode needs (worker endpoints, waiters,
//!   stage outputs, busy time, metrics). One driver, three users:
//! - [`Orchestrator`]: library mode, stage workers as async handlers in this process;
//! - [`service`]: the network service, its protocol and its worker / submitter clients;
//! - the `tensorwire simulate` command, which drives it with a virtual clock.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use tensorwire_orchestrator::sched::{MaxFreeCredit, SchedConfig, Submit};
//! use tensorwire_orchestrator::{HandlerError, Orchestrator, Outcome, Priority, Stage, Work};
//!
//! let o = Orchestrator::start(SchedConfig::default(), Box::new(MaxFreeCredit));
//! for stage in Stage::ALL {
//!     let run = |_w: Work| async { Ok::<(), HandlerError>(()) };
//!     o.add_worker(stage, 1, "localhost", Arc::new(run)).await?;
//! }
//! let done = o.submit(Submit::new(1, Priority::Interactive)).await?;
//! assert_eq!(done.await.unwrap(), Outcome::Completed { request: 1 });
//! # Ok::<(), tensorwire_orchestrator::OrchestratorError>(()) }).unwrap();
//! ```

mod clock;
mod driver;
mod error;
mod fasthash;
pub mod journal;
mod library;
pub mod queue;
pub mod rebalance;
pub mod sched;
pub mod service;
mod stage;
pub mod timeline;

pub use driver::{Assignment, Driver, Ended, OrchestratorStats, StageResult};
pub use error::{OrchestratorError, Result};
pub use library::{HandlerError, Orchestrator, StageHandler, Work};
pub use queue::{Affinity, Priority, QueueMessage};
pub use sched::Outcome;
pub use stage::Stage;
