//! What tensorwire's own tests share and no third party needs: a fault proxy for TCP between two
//! processes ([`faults`]), a GPU for machines without one whose device memory the CPU cannot touch
//! ([`fake_gpu`]), and a client that tries a listener without the cluster secret ([`intruder`]).
//! Not published: the suites a backend or store author runs are in `tensorwire-conformance`.

pub mod fake_gpu;
pub mod faults;
pub mod intruder;
