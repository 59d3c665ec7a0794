//! The integration tests of `tensorwire-orchestrator`, in one test binary: a module per concern.

mod cache;
mod checkpoint;
mod codecs;
mod inputs;
mod preempt;
mod restart;
mod secure;
mod service;

tensorwire_conformance::children! { "decode_worker" => service::decode_worker_child }
