#![no_main]
//! Step-checkpoint references (what a worker hands the orchestrator and a next try decodes):
//! any bytes decode to a reference or an error, never a panic; what decodes re-encodes to the
//! same reference.
use libfuzzer_sys::fuzz_target;
use tensorwire_diffusion::cache::CheckpointRef;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = CheckpointRef::decode(data) {
        assert_eq!(CheckpointRef::decode(&r.encode()).ok(), Some(r));
    }
});
