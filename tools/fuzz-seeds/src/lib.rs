//! Seed corpora and dictionaries for the fuzz targets in `fuzz/`. A decoder behind a magic number
//! is barely fuzzed from an empty corpus, so every target starts from real messages: the traffic
//! of real sessions recorded on loopback ([`traffic`]), and every variant of every message built
//! directly ([`variants`]). `cargo run -p tensorwire-fuzz-seeds` rewrites `fuzz/corpus/` and
//! `fuzz/dict/`; the test `checked_in` keeps the checked-in seeds decodable as formats change.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use sha2::{Digest, Sha256};

pub mod record;
pub mod split;
pub mod targets;
pub mod traffic;
pub mod variants;

/// Errors of the generator (engines, stores, IO: all reported, none recovered).
pub type Error = Box<dyn std::error::Error + Send + Sync>;
/// Result of the generator.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Largest seed kept (libFuzzer's default input bound is 4 KiB; seeds may exceed it a little).
pub const MAX_SEED: usize = 16 << 10;

/// Seeds per target.
#[derive(Debug, Default)]
pub struct Corpus {
    seeds: BTreeMap<&'static str, BTreeSet<Vec<u8>>>,
    /// Inputs offered for a target whose decoder refused them (a generator bug).
    pub rejected: Vec<(&'static str, Vec<u8>)>,
}

impl Corpus {
    /// Adds `input` to `target`'s seeds if that target's decoder accepts it.
    pub fn add(&mut self, target: &'static str, input: Vec<u8>) {
        if input.len() > MAX_SEED {
            return;
        }
        if targets::valid(target, &input) {
            self.seeds.entry(target).or_default().insert(input);
        } else {
            self.rejected.push((target, input));
        }
    }

    /// [`Corpus::add`] for an encoder that can fail (an encoding error is a rejected seed).
    pub fn add_result<E>(&mut self, target: &'static str, input: std::result::Result<Vec<u8>, E>) {
        match input {
            Ok(i) => self.add(target, i),
            Err(_) => self.rejected.push((target, Vec::new())),
        }
    }

    /// `target`'s seeds.
    pub fn seeds(&self, target: &str) -> impl Iterator<Item = &Vec<u8>> {
        self.seeds.get(target).into_iter().flatten()
    }

    /// Gives the structured `roundtrip` target a sample of every other target's seeds (any bytes
    /// are a valid input there; these are varied ones).
    pub fn seed_roundtrip(&mut self) {
        let sample: Vec<Vec<u8>> = self
            .seeds
            .iter()
            .filter(|(t, _)| **t != "roundtrip")
            .flat_map(|(_, s)| s.iter().take(4).cloned())
            .collect();
        for s in sample {
            self.add("roundtrip", s);
        }
    }

    /// Replaces `dir/TARGET/*` with the seeds (one file per seed, named by its hash) and writes
    /// `dict_dir/TARGET.dict` for targets with a dictionary.
    pub fn write(&self, dir: &Path, dict_dir: &Path) -> Result<()> {
        for target in targets::TARGETS {
            let d = dir.join(target);
            if d.exists() {
                std::fs::remove_dir_all(&d)?;
            }
            std::fs::create_dir_all(&d)?;
            for s in self.seeds(target) {
                let name: String =
                    Sha256::digest(s)[..8].iter().map(|b| format!("{b:02x}")).collect();
                std::fs::write(d.join(name), s)?;
            }
            let tokens = targets::dictionary(target);
            if !tokens.is_empty() {
                std::fs::create_dir_all(dict_dir)?;
                let file = targets::dictionary_file(&tokens);
                std::fs::write(dict_dir.join(format!("{target}.dict")), file)?;
            }
        }
        Ok(())
    }
}

/// Records the sessions and builds every variant.
pub async fn generate() -> Result<Corpus> {
    let mut c = Corpus::default();
    let refs = traffic::record_all(&mut c).await?;
    variants::add_all(&mut c, &refs);
    c.seed_roundtrip();
    Ok(c)
}
