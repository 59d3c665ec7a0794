//! `ChunkTracker`: the consumer's view of a chunked transfer. Pure state: landed marks, the count
//! still missing, and the first failure; every chunk is reported exactly once.

use crate::error::{Error, Result};

/// Tracks which chunks of a plan have landed.
#[derive(Debug, Clone)]
pub struct ChunkTracker {
    landed: Vec<bool>,
    remaining: u32,
    failed: Option<Error>,
}

impl ChunkTracker {
    /// A tracker for `count` chunks.
    pub fn new(count: u32) -> Self {
        Self { landed: vec![false; count as usize], remaining: count, failed: None }
    }

    /// Records chunk `index` as landed. A duplicate or an index past the plan is a protocol error
    /// and fails the transfer.
    pub fn on_landed(&mut self, index: u32) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let err = match self.landed.get_mut(index as usize) {
            Some(slot) if !*slot => {
                *slot = true;
                self.remaining -= 1;
                return Ok(());
            }
            Some(_) => Error::protocol(format!("chunk {index} reported landed twice")),
            None => Error::protocol(format!(
                "chunk {index} reported for a {}-chunk plan",
                self.landed.len()
            )),
        };
        self.failed = Some(err.clone());
        Err(err)
    }

    /// Records a failure (producer abort, timeout); later calls return it.
    pub fn fail(&mut self, e: Error) {
        self.failed.get_or_insert(e);
    }

    /// The failure, if any.
    pub fn failure(&self) -> Option<&Error> {
        self.failed.as_ref()
    }

    /// Chunks not landed yet.
    pub fn remaining(&self) -> u32 {
        self.remaining
    }

    /// All chunks landed and nothing failed.
    pub fn is_complete(&self) -> bool {
        self.remaining == 0 && self.failed.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn duplicates_and_strays_fail_the_transfer() {
        let mut t = ChunkTracker::new(3);
        t.on_landed(2).unwrap();
        assert!(t.on_landed(2).is_err());
        assert!(t.on_landed(0).is_err(), "a failed tracker stays failed");
        let mut t = ChunkTracker::new(1);
        assert!(t.on_landed(1).is_err());
    }

    proptest! {
        /// Any permutation of indices completes exactly once, with every index seen once.
        #[test]
        fn any_order_completes(order in Just((0u32..12).collect::<Vec<_>>()).prop_shuffle()) {
            let mut t = ChunkTracker::new(12);
            for (n, &i) in order.iter().enumerate() {
                prop_assert!(!t.is_complete());
                t.on_landed(i).unwrap();
                prop_assert_eq!(t.remaining(), 11 - n as u32);
            }
            prop_assert!(t.is_complete());
        }

        #[test]
        fn arbitrary_inputs_never_panic(seq in proptest::collection::vec(any::<u32>(), 0..64), n in 0u32..16) {
            let mut t = ChunkTracker::new(n);
            for i in seq {
                let _ = t.on_landed(i % 20);
            }
        }
    }
}
