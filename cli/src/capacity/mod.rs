//! The capacity model behind `tensorwire simulate`: GPU classes, the memory fit of a pool,
//! layouts (stages grouped into pools on classes), workload mixes, the discrete-event run with
//! the orchestrator's scheduler, the layout search and the calibration against published results.

pub(crate) mod calibrate;
pub(crate) mod classes;
pub(crate) mod engine;
pub(crate) mod fit;
pub(crate) mod layout;
pub(crate) mod plan;
pub(crate) mod shift;
pub(crate) mod workload;
