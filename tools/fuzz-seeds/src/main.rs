//! `cargo run -p tensorwire-fuzz-seeds [-- CORPUS_DIR DICT_DIR]`: records real sessions on loopback,
//! builds every message variant, and rewrites the fuzz targets' seed corpora and dictionaries
//! (default `fuzz/corpus` and `fuzz/dict` of this checkout).

use std::path::PathBuf;
use std::process::ExitCode;

use tensorwire_fuzz_seeds::targets::TARGETS;

#[tokio::main]
async fn main() -> ExitCode {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let corpus = args.next().unwrap_or_else(|| root.join("corpus"));
    let dict = args.next().unwrap_or_else(|| root.join("dict"));
    let c = match tensorwire_fuzz_seeds::generate().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fuzz-seeds: {e}");
            return ExitCode::FAILURE;
        }
    };
    if !c.rejected.is_empty() {
        for (t, input) in &c.rejected {
            eprintln!("fuzz-seeds: {t} refuses a generated seed of {} bytes", input.len());
        }
        return ExitCode::FAILURE;
    }
    if let Err(e) = c.write(&corpus, &dict) {
        eprintln!("fuzz-seeds: writing {}: {e}", corpus.display());
        return ExitCode::FAILURE;
    }
    for t in TARGETS {
        println!("{t:<20} {:>4} seeds", c.seeds(t).count());
    }
    ExitCode::SUCCESS
}
