//! The cache-key test vectors (`tests/it/cache_keys.txt`): every line's key, computed here, matches
//! the hex on the line. Another implementation of the format (see `cache::keys`) must match them
//! too. Lines: `embedding|encoder|version|prompt|negative(0/1)|name=value,...|hex`,
//! `cfg|model|negative-prompt key hex|step|width|height|frames|sampler|state hex|hex`,
//! `checkpoint|model|sampler|state hex|step|seed|guidance|width|height|frames|prompt key hex|hex`.

use tensorwire_diffusion::cache::{
    CacheKey, CheckpointOf, Sampler, Shape, cfg_key, checkpoint_key, embedding_key,
};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn key(s: &str) -> CacheKey {
    CacheKey(unhex(s).try_into().unwrap())
}

/// The key a vector line describes (without its expected hex).
fn compute(f: &[&str]) -> CacheKey {
    let n = |s: &str| s.parse::<u32>().unwrap();
    match f[0] {
        "embedding" => {
            let params: Vec<(&str, &str)> = if f[5].is_empty() {
                Vec::new()
            } else {
                f[5].split(',').map(|p| p.split_once('=').unwrap()).collect()
            };
            embedding_key(f[1], f[2], f[3], f[4] == "1", &params)
        }
        "cfg" => {
            let state = unhex(f[8]);
            let shape = Shape { width: n(f[4]), height: n(f[5]), frames: n(f[6]) };
            cfg_key(f[1], &key(f[2]), n(f[3]), shape, Sampler { name: f[7], state: &state })
        }
        "checkpoint" => {
            let state = unhex(f[3]);
            checkpoint_key(&CheckpointOf {
                model: f[1],
                sampler: Sampler { name: f[2], state: &state },
                step: n(f[4]),
                seed: f[5].parse().unwrap(),
                guidance_scale: f[6].parse().unwrap(),
                shape: Shape { width: n(f[7]), height: n(f[8]), frames: n(f[9]) },
                prompt: key(f[10]),
            })
        }
        k => panic!("unknown kind {k}"),
    }
}

#[test]
fn every_vector_matches() {
    let text = include_str!("cache_keys.txt");
    let mut checked = 0;
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('|').collect();
        let (want, fields) = f.split_last().unwrap();
        assert_eq!(compute(fields).hex(), *want, "{line}");
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} vectors");
}

/// Prints the vectors' lines with keys computed by this implementation (used once to write
/// the file; run with `-- --ignored --nocapture` to see them).
#[test]
#[ignore]
fn print_vectors() {
    for line in include_str!("cache_keys.txt").lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split('|').collect();
        let (_, fields) = f.split_last().unwrap();
        println!("{}|{}", fields.join("|"), compute(fields).hex());
    }
}
