//! Placement inside the store's pool: best-fit over free extents kept in offset order (so freeing
//! coalesces with both neighbours) and in (size, offset) order (so best fit is one range query).
//! Every block is a multiple of [`ALIGN`], which keeps objects page-aligned for O_DIRECT spill and
//! bounds the metadata per object. Pure and sans-IO; property-tested below.

use std::collections::{BTreeMap, BTreeSet};

/// Block granularity and alignment.
pub const ALIGN: u64 = 4096;

/// Requests below this size are placed from the top of the pool.
pub const SMALL: u64 = 1 << 20;

/// A best-fit extent allocator over `[0, capacity)`.
#[derive(Debug, Clone)]
pub struct Allocator {
    capacity: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    used: u64,
}

/// Rounds `len` up to the block granularity (at least one block).
pub fn block_len(len: u64) -> Option<u64> {
    len.max(1).checked_next_multiple_of(ALIGN)
}

impl Allocator {
    /// An empty allocator over `capacity` bytes (rounded down to [`ALIGN`]).
    pub fn new(capacity: u64) -> Allocator {
        let capacity = capacity / ALIGN * ALIGN;
        let mut a =
            Allocator { capacity, by_offset: BTreeMap::new(), by_size: BTreeSet::new(), used: 0 };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    /// Pool size.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes in allocated blocks.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The largest block `alloc` could return now.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Number of free extents (a fragmentation indicator).
    pub fn free_extents(&self) -> usize {
        self.by_offset.len()
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.by_offset.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.by_offset.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// Allocates a block for `len` bytes; returns its offset and block length.
    ///
    /// Large requests take the best-fitting extent from its low end; small ones (under
    /// [`SMALL`]) take the highest-addressed extent that fits, from its high end. Small objects
    /// thus gather at the top of the pool and stop punching holes between large ones.
    pub fn alloc(&mut self, len: u64) -> Option<(u64, u64)> {
        let need = block_len(len)?;
        if need < SMALL {
            let (&off, &flen) = self.by_offset.iter().rev().find(|&(_, &l)| l >= need)?;
            self.remove_free(off, flen);
            if flen > need {
                self.insert_free(off, flen - need);
            }
            self.used += need;
            return Some((off + flen - need, need));
        }
        let &(flen, off) = self.by_size.range((need, 0)..).next()?;
        self.remove_free(off, flen);
        if flen > need {
            self.insert_free(off + need, flen - need);
        }
        self.used += need;
        Some((off, need))
    }

    /// Frees a block returned by `alloc` (offset and block length), merging with free neighbours.
    pub fn free(&mut self, off: u64, len: u64) {
        let (mut start, mut size) = (off, len);
        if let Some((&poff, &plen)) = self.by_offset.range(..off).next_back() {
            if poff + plen == off {
                self.remove_free(poff, plen);
                start = poff;
                size += plen;
            }
        }
        if let Some(&nlen) = self.by_offset.get(&(off + len)) {
            self.remove_free(off + len, nlen);
            size += nlen;
        }
        self.insert_free(start, size);
        self.used -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_coalescing() {
        const U: u64 = SMALL; // large requests: best fit from the bottom
        let mut a = Allocator::new(16 * U);
        let x = a.alloc(U).unwrap();
        let y = a.alloc(3 * U).unwrap();
        let z = a.alloc(U + 1).unwrap();
        assert_eq!((x, y, z), ((0, U), (U, 3 * U), (4 * U, U + ALIGN)));
        a.free(y.0, y.1);
        // A 1-unit request takes the 3-unit hole (best fit is the smallest that fits).
        let w = a.alloc(U).unwrap();
        assert_eq!(w.0, U);
        // Small requests come from the top.
        let s = a.alloc(1).unwrap();
        assert_eq!(s, (16 * U - ALIGN, ALIGN));
        a.free(s.0, s.1);
        a.free(w.0, w.1);
        a.free(x.0, x.1);
        a.free(z.0, z.1);
        assert_eq!(a.free_extents(), 1);
        assert_eq!(a.largest_free(), 16 * U);
        assert_eq!(a.used(), 0);
        assert!(a.alloc(17 * U).is_none());
    }

    proptest! {
        /// Blocks never overlap, stay inside the pool, and freeing everything restores one extent.
        #[test]
        fn no_overlap_and_full_recovery(ops in proptest::collection::vec((any::<bool>(), 1u64..40_000), 1..200)) {
            let mut a = Allocator::new(1 << 20);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (free, len) in ops {
                if free && !live.is_empty() {
                    let (o, l) = live.swap_remove(len as usize % live.len());
                    a.free(o, l);
                } else if let Some((o, l)) = a.alloc(len) {
                    prop_assert!(o % ALIGN == 0 && l >= len && o + l <= a.capacity());
                    for &(p, q) in &live {
                        prop_assert!(o + l <= p || p + q <= o, "overlap");
                    }
                    live.push((o, l));
                }
                prop_assert_eq!(a.used(), live.iter().map(|b| b.1).sum::<u64>());
            }
            for (o, l) in live {
                a.free(o, l);
            }
            prop_assert_eq!(a.free_extents(), 1);
            prop_assert_eq!(a.largest_free(), a.capacity());
        }
    }
}
