//! A fast hasher for the scheduler's small integer keys (worker ids, request ids, item keys):
//! one rotate, xor and multiply per word, instead of SipHash's rounds. It does not resist
//! chosen keys (HashDoS); the keys it hashes come from the service's authenticated clients and
//! from the scheduler itself.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The mixing constant (an odd 64-bit number with well-spread bits, as in FxHash).
const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// The hasher.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl FastHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.add(u64::from(v));
    }

    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }

    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }

    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }

    #[inline]
    fn write_isize(&mut self, v: isize) {
        self.add(v as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map with the fast hasher.
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn nearby_keys_spread_over_the_high_bits() {
        // hashbrown takes its control bytes from the top 7 bits: consecutive ids must differ
        // there too.
        let b = BuildHasherDefault::<FastHasher>::default();
        let tops: std::collections::HashSet<u64> =
            (0u64..1024).map(|i| b.hash_one(i) >> 57).collect();
        assert!(tops.len() > 100, "only {} distinct top-7-bit values", tops.len());
        let key = |r: u64, s: u8| b.hash_one((r, s));
        assert_ne!(key(1, 0), key(1, 1));
        assert_ne!(key(1, 0), key(0, 1));
    }
}
