//! `ReadySet`: the producer's "chunk i is ready" marks, shared by every thread that finishes chunks.
//! Each index is accepted once; exactly one caller learns that it marked the last chunk.

use crate::error::{Error, Result};
use crate::sync::{AtomicU64, AtomicUsize, Ordering};

/// Outcome of marking a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Marked {
    /// This call marked the last outstanding chunk.
    pub(crate) last: bool,
}

/// Lock-free set of ready chunk indices.
#[derive(Debug)]
pub(crate) struct ReadySet {
    bits: Vec<AtomicU64>,
    count: u32,
    remaining: AtomicUsize,
}

impl ReadySet {
    pub(crate) fn new(count: u32) -> Self {
        let words = (count as usize).div_ceil(64);
        Self {
            bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
            count,
            remaining: AtomicUsize::new(count as usize),
        }
    }

    /// Marks `index`; an index past the plan or one marked before is an error.
    pub(crate) fn mark(&self, index: u32) -> Result<Marked> {
        if index >= self.count {
            return Err(Error::InvalidArgument(format!(
                "chunk {index} marked ready in a {}-chunk plan",
                self.count
            )));
        }
        let bit = 1u64 << (index % 64);
        let prev = self.bits[(index / 64) as usize].fetch_or(bit, Ordering::AcqRel);
        if prev & bit != 0 {
            return Err(Error::InvalidArgument(format!("chunk {index} marked ready twice")));
        }
        let last = self.remaining.fetch_sub(1, Ordering::AcqRel) == 1;
        Ok(Marked { last })
    }

    /// Chunks not marked yet.
    pub(crate) fn remaining(&self) -> usize {
        self.remaining.load(Ordering::Acquire)
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two threads mark the two chunks: exactly one of them sees `last`.
    #[test]
    fn loom_ready_set_exactly_one_last() {
        loom::model(|| {
            let set = Arc::new(ReadySet::new(2));
            let s2 = set.clone();
            let t = loom::thread::spawn(move || s2.mark(1).unwrap().last);
            let a = set.mark(0).unwrap().last;
            let b = t.join().unwrap();
            assert!(a ^ b);
            assert_eq!(set.remaining(), 0);
        });
    }

    /// Two threads race to mark the same chunk: exactly one succeeds.
    #[test]
    fn loom_ready_set_same_chunk_once() {
        loom::model(|| {
            let set = Arc::new(ReadySet::new(2));
            let s2 = set.clone();
            let t = loom::thread::spawn(move || s2.mark(0).is_ok());
            let a = set.mark(0).is_ok();
            let b = t.join().unwrap();
            assert!(a ^ b);
            assert_eq!(set.remaining(), 1);
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn marks_once_and_reports_last() {
        let s = ReadySet::new(130);
        for i in 0..129 {
            assert!(!s.mark(i).unwrap().last);
        }
        assert!(s.mark(5).is_err());
        assert!(s.mark(130).is_err());
        assert!(s.mark(129).unwrap().last);
    }
}
