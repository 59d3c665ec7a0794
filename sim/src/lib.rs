//! tensorwire-sim: the capacity model behind `tensorwire simulate`: GPU classes, the memory fit of a pool,
//! layouts (stages grouped into pools on classes), workload mixes, the discrete-event run with
//! the orchestrator's scheduler, the layout search and the calibration against published results.

pub mod calibrate;
pub mod classes;
pub mod engine;
pub mod error;
pub mod fit;
pub mod layout;
pub mod plan;
pub mod profiles;
pub mod rng;
pub mod shift;
pub mod workload;

pub use error::{Error, Result};
