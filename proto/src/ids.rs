//! Identifiers: engines, regions, access keys.

use std::fmt;

/// A random 128-bit engine identity, fresh each time an engine starts.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineId(pub u128);

impl EngineId {
    /// A fresh random value.
    pub fn random() -> Self {
        EngineId(rand::random())
    }
}

impl fmt::Debug for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "engine-{:08x}", (self.0 >> 96) as u32)
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A region's id on the engine that registered it (never reused by that engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// The random 128-bit key a peer must present to touch a region. Compared in constant time.
#[derive(Clone, Copy)]
pub struct AccessKey(u128);

impl AccessKey {
    /// A fresh random value.
    pub fn random() -> Self {
        AccessKey(rand::random())
    }
    /// The key's bits (for wire formats).
    pub fn to_bits(self) -> u128 {
        self.0
    }
    /// A key from its bits.
    pub fn from_bits(bits: u128) -> Self {
        AccessKey(bits)
    }
}

impl PartialEq for AccessKey {
    fn eq(&self, other: &Self) -> bool {
        let diff = self.0 ^ other.0;
        // Fold without early exit so the comparison time does not depend on where keys differ.
        let folded = (diff as u64) | ((diff >> 64) as u64);
        std::hint::black_box(folded) == 0
    }
}
impl Eq for AccessKey {}

impl fmt::Debug for AccessKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AccessKey(..)")
    }
}
