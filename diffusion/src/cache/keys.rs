//! Cache keys, a stable format: a key is the SHA-256 of a canonical encoding of what the cached
//! value depends on, so any process (or another implementation) computes the same key for the
//! same inputs. The encoding, version 1:
//!
//! ```text
//! domain   the ASCII tag of the kind ("tensorwire/embedding", "tensorwire/cfg",
//!          "tensorwire/checkpoint") as a string (below)
//! version  one byte, 1
//! fields   in the order each kind lists them:
//!   string   u32 little-endian byte length, then the UTF-8 bytes
//!   bytes    u32 little-endian length, then the bytes
//!   u32/u64  little-endian
//!   f32      its IEEE-754 bits as a little-endian u32 (7.5 and 7.50 are the same key;
//!            -0.0 and 0.0 are not)
//!   bool     one byte, 0 or 1
//!   key      the 32 bytes of another key (e.g. the prompt's)
//!   params   u32 count, then (string name, string value) pairs sorted by name, then by value
//! ```
//!
//! Kinds:
//! - embedding: encoder id (string), encoder version (string), prompt (string), negative
//!   (bool: the prompt is a negative prompt), params (the encoder's parameters that change
//!   its output, e.g. max length).
//! - cfg (the unconditional branch's features, shared across requests with the same negative
//!   prompt): model (string), negative prompt's embedding key (key), step (u32), width,
//!   height, frames (u32 each), sampler name (string), sampler state (bytes).
//! - checkpoint (latents at a step, portable across denoise workers): model (string), sampler
//!   name (string), sampler state (bytes), step (u32), seed (u64), guidance scale (f32),
//!   width, height, frames (u32 each), prompt's embedding key (key).
//!
//! Test vectors: `diffusion/tests/it/cache_keys.txt` (`cargo test -p tensorwire-diffusion --test
//! it cache_keys` checks them).

use sha2::{Digest, Sha256};

/// The encoding's version.
pub const VERSION: u8 = 1;

/// A cache key: 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    /// Lower-case hex.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The store key of this cache key in cache `kind` (e.g. "emb"): `tw/cache/<kind>/<hex>`.
    pub fn store_key(&self, kind: &str) -> Vec<u8> {
        format!("tw/cache/{kind}/{}", self.hex()).into_bytes()
    }
}

/// The canonical encoder.
struct Canon(Sha256);

impl Canon {
    fn new(domain: &str) -> Canon {
        let mut c = Canon(Sha256::new());
        c.str(domain);
        c.0.update([VERSION]);
        c
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.update((b.len() as u32).to_le_bytes());
        self.0.update(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.update(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.update(v.to_le_bytes());
        self
    }
    fn key(&mut self, k: &CacheKey) -> &mut Self {
        self.0.update(k.0);
        self
    }
    fn finish(self) -> CacheKey {
        CacheKey(self.0.finalize().into())
    }
}

/// A sampler's name and its state (e.g. the scheduler's timesteps and sigmas, serialized by
/// the framework the same way every time).
#[derive(Debug, Clone, Copy)]
pub struct Sampler<'a> {
    /// e.g. "flow-match-euler".
    pub name: &'a str,
    /// Its state, as bytes.
    pub state: &'a [u8],
}

/// Image or video size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Pixels.
    pub width: u32,
    /// Pixels.
    pub height: u32,
    /// Frames (1 for an image).
    pub frames: u32,
}

/// The key of a condition embedding.
pub fn embedding_key(
    encoder: &str,
    encoder_version: &str,
    prompt: &str,
    negative: bool,
    params: &[(&str, &str)],
) -> CacheKey {
    let mut c = Canon::new("tensorwire/embedding");
    c.str(encoder).str(encoder_version).str(prompt);
    c.0.update([u8::from(negative)]);
    let mut p = params.to_vec();
    p.sort_unstable();
    c.u32(p.len() as u32);
    for (k, v) in p {
        c.str(k).str(v);
    }
    c.finish()
}

/// The key of the unconditional branch's features at `step`.
pub fn cfg_key(
    model: &str,
    negative_prompt: &CacheKey,
    step: u32,
    shape: Shape,
    sampler: Sampler<'_>,
) -> CacheKey {
    let mut c = Canon::new("tensorwire/cfg");
    c.str(model).key(negative_prompt).u32(step);
    c.u32(shape.width).u32(shape.height).u32(shape.frames);
    c.str(sampler.name).bytes(sampler.state);
    c.finish()
}

/// What a step checkpoint depends on.
#[derive(Debug, Clone, Copy)]
pub struct CheckpointOf<'a> {
    /// Model id.
    pub model: &'a str,
    /// Sampler and its state.
    pub sampler: Sampler<'a>,
    /// Denoising step the latents are at.
    pub step: u32,
    /// Noise seed.
    pub seed: u64,
    /// Classifier-free guidance scale.
    pub guidance_scale: f32,
    /// Output size.
    pub shape: Shape,
    /// The prompt's embedding key.
    pub prompt: CacheKey,
}

/// The key of a step checkpoint.
pub fn checkpoint_key(k: &CheckpointOf<'_>) -> CacheKey {
    let mut c = Canon::new("tensorwire/checkpoint");
    c.str(k.model).str(k.sampler.name).bytes(k.sampler.state);
    c.u32(k.step).u64(k.seed).u32(k.guidance_scale.to_bits());
    c.u32(k.shape.width).u32(k.shape.height).u32(k.shape.frames);
    c.key(&k.prompt);
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_every_field_and_not_on_param_order() {
        let a = embedding_key(
            "umt5-xxl",
            "1",
            "a cat",
            false,
            &[("max_len", "512"), ("dtype", "bf16")],
        );
        let b = embedding_key(
            "umt5-xxl",
            "1",
            "a cat",
            false,
            &[("dtype", "bf16"), ("max_len", "512")],
        );
        assert_eq!(a, b, "params are sorted");
        assert_ne!(
            a,
            embedding_key("umt5-xxl", "1", "a cat", true, &[("max_len", "512"), ("dtype", "bf16")])
        );
        assert_ne!(
            a,
            embedding_key(
                "umt5-xxl",
                "2",
                "a cat",
                false,
                &[("max_len", "512"), ("dtype", "bf16")]
            )
        );
        // Length prefixes keep field boundaries: "ab"+"c" differs from "a"+"bc".
        assert_ne!(
            embedding_key("ab", "c", "", false, &[]),
            embedding_key("a", "bc", "", false, &[])
        );
        let s = Sampler { name: "euler", state: b"" };
        let shape = Shape { width: 832, height: 480, frames: 81 };
        assert_ne!(cfg_key("wan", &a, 1, shape, s), cfg_key("wan", &a, 2, shape, s));
        let ck = CheckpointOf {
            model: "wan",
            sampler: s,
            step: 10,
            seed: 42,
            guidance_scale: 5.0,
            shape,
            prompt: a,
        };
        assert_ne!(checkpoint_key(&ck), checkpoint_key(&CheckpointOf { seed: 43, ..ck }));
        assert_eq!(a.store_key("emb").len(), "tw/cache/emb/".len() + 64);
    }
}
