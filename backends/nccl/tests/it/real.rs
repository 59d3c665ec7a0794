//! The NCCL data path needs two GPUs, one per rank (a communicator cannot have both ranks on one
//! device). The run on two GPUs is not wired yet (each engine needs its own GPU ordinal; see the
//! NCCL chapter of the book, docs/book/src/backends/nccl.md), so the test is ignored, saying so;
//! asked for, it fails with the reason rather than report a pass it did not run.

#[test]
#[ignore = "needs two GPUs, and the two-GPU run is not wired yet (docs/book/src/backends/nccl.md)"]
fn nccl_conformance_on_two_gpus() {
    let why = match tensorwire_nccl::CudaNccl::new() {
        Err(e) => e.to_string(),
        Ok(_) => "the two-GPU run is not wired yet".into(),
    };
    panic!("not run: {why}");
}
