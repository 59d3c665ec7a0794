//! The `DiffusionConnector`: what a stage worker calls to hand its output to the next stage and to
//! fetch its inputs. The decisions are the sans-IO state machines of [`crate::handoff`]; this
//! module is the IO around them (the engine, the store, the notification stream): `publish`
//! (the producer's side), `inbox` (notifications from consumers) and `consume` (the
//! consumer's side), over the connector's shared state here.
//!
//! - **p2p**: the payload stays in the producer's registered buffer (kept alive by the connector
//!   until its lease ends and no consumer holds it). A consumer subscribes, holding the buffer
//!   while it reads; the producer announces chunks as it marks them ready; the consumer READs each
//!   chunk's byte ranges straight into its destination as soon as it is announced (an unchunked
//!   payload's read starts with the subscription) and yields a view per chunk, in landing order;
//!   then reports it consumed.
//! - **store**: once every chunk is ready the producer's bytes go to the store (`put_from`) and the
//!   buffer is released; the consumer waits (bounded) for the key, `get_into`s its destination,
//!   and the store's lease (consumer count or TTL) removes the object.
//! - **auto**: p2p when the consumer is known and has credit at publish time, store otherwise.
//!
//! Every wait is bounded by [`ConnectorConfig::wait_timeout`]; a producer that died surfaces as
//! [`ConnectorError::ProducerGone`](crate::ConnectorError::ProducerGone) or a timeout, never a hang.
//!
//! [`DiffusionConnector::new`] is in `inbox`: it wires the engine's notification stream.

mod consume;
mod inbox;
mod publish;
mod state;
mod turn;

pub use consume::Consumption;
pub use publish::Publication;
pub use state::{ChunkView, ConnectorConfig, ConsumerHint, DiffusionConnector, Mode};
