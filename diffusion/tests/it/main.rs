//! The integration tests of `tensorwire-diffusion`, in one test binary: a module per concern.

mod cache;
mod cache_keys;
mod codecs;
mod handoff;
mod handoff_state;
mod holds;
mod processes;

tensorwire_conformance::children! { "worker" => processes::worker_child }
