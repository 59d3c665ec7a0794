//! What tensorwire's own tests share and no third party needs: a fault proxy for TCP between two
//! processes ([`faults`]), a GPU for machines without one whose device memory the CPU cannot touch
//! ([`fake_gpu`]) and, with the feature `cuda`, a CUDA IPC driver over it (`fake_ipc`), and a
//! client that tries a listener without the cluster secret ([`intruder`]).
//! Not published: the suites a backend or store author runs are in `tensorwire-conformance`.

pub mod fake_gpu;
#[cfg(feature = "cuda")]
pub mod fake_ipc;
pub mod faults;
pub mod intruder;
