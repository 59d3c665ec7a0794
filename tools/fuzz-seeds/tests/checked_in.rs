//! The checked-in corpora and dictionaries stay in step with the code: every fuzz target has a
//! corpus, every seed is still a well-formed input of its target (a format change that breaks
//! one means regenerating: `cargo run -p tensorwire-fuzz-seeds`), the dictionaries list the
//! current magic numbers, and the generator itself runs clean.

use std::path::{Path, PathBuf};

use tensorwire_fuzz_seeds::targets::{self, TARGETS};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

#[test]
fn every_fuzz_target_has_a_corpus_of_valid_seeds() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let mut declared: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .filter_map(|l| l.strip_suffix('"'))
        .filter(|n| *n != "tensorwire-fuzz")
        .collect();
    declared.sort_unstable();
    assert_eq!(declared, TARGETS, "fuzz/Cargo.toml and targets::TARGETS list different targets");
    for t in TARGETS {
        let dir = fuzz_dir().join("corpus").join(t);
        // Generated seeds are named by 16 hex digits; inputs a local fuzzing run added (40 hex
        // digits, libFuzzer's names) are not seeds and need not be well formed.
        let seeds: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().is_some_and(|n| n.len() == 16))
            .collect();
        assert!(!seeds.is_empty(), "{t}: empty corpus");
        for s in seeds {
            let bytes = std::fs::read(&s).unwrap();
            assert!(targets::valid(t, &bytes), "{}: no longer a valid {t} input", s.display());
        }
    }
}

#[test]
fn dictionaries_list_the_current_constants() {
    for t in TARGETS {
        let tokens = targets::dictionary(t);
        let path = fuzz_dir().join("dict").join(format!("{t}.dict"));
        if tokens.is_empty() {
            assert!(!path.exists(), "{}: stale dictionary", path.display());
        } else {
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            assert_eq!(on_disk, targets::dictionary_file(&tokens), "{}", path.display());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generator_records_every_target() {
    let c = tensorwire_fuzz_seeds::generate().await.unwrap();
    assert!(c.rejected.is_empty(), "{} generated seeds were refused", c.rejected.len());
    for t in TARGETS {
        assert!(c.seeds(t).next().is_some(), "{t}: no seeds");
    }
    // Recorded, not only built: the handshake of two engines and their descriptors.
    assert!(c.seeds("engine_descriptor").count() >= 2);
    assert!(c.seeds("connector_control").count() >= 3);
}
