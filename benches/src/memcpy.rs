//! The memcpy baseline: one copy of the same bytes between two buffers of this process.

use std::time::Instant;

/// Two page-touched buffers of `max` bytes, each starting on a page: the source at the start of
/// its page, the destination `distance` bytes into its page.
///
/// Where the two start matters: glibc's memcpy on AMD CPUs crawls (about 3 GB/s instead of
/// 30-80) when the destination is 1 to 63 bytes past the source modulo a page, which two
/// `Vec`s allocated one after the other can be (each starts 16 bytes past a `malloc` header).
/// The baseline is the medium's best case, distance 0, unless a caller asks for another.
#[derive(Debug)]
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
    /// Where the source and destination start in `src` and `dst`.
    at: (usize, usize),
    len: usize,
}

impl Memcpy {
    /// Allocates and touches both buffers, page-aligned (distance 0).
    pub fn new(max: u64) -> Memcpy {
        Memcpy::with_distance(max, 0)
    }

    /// Allocates and touches both buffers, the destination `distance` (taken modulo 4096) bytes
    /// further into its page than the source.
    pub fn with_distance(max: u64, distance: usize) -> Memcpy {
        const PAGE: usize = 4096;
        let len = usize::try_from(max).unwrap_or(usize::MAX);
        let room = len.saturating_add(2 * PAGE);
        let (src, dst) = (vec![1u8; room], vec![2u8; room]);
        let a = src.as_ptr().align_offset(PAGE);
        let b = dst.as_ptr().align_offset(PAGE) + distance % PAGE;
        Memcpy { src, dst, at: (a, b), len }
    }

    /// Copies `size` bytes once.
    pub fn copy(&mut self, size: u64) {
        let (src, dst) = self.ends(size);
        dst.copy_from_slice(src);
        std::hint::black_box(dst);
    }

    /// The source and destination of a `size`-byte copy (for another copier to use).
    pub fn ends(&mut self, size: u64) -> (&[u8], &mut [u8]) {
        let n = (size as usize).min(self.len);
        let (a, b) = self.at;
        (&self.src[a..a + n], &mut self.dst[b..b + n])
    }

    /// GB/s of copying `size` bytes repeatedly for the budget.
    pub fn gbps(&mut self, size: u64, budget: crate::measure::Budget) -> f64 {
        self.copy(size);
        let start = Instant::now();
        let mut n = 0u64;
        while n < budget.max_iters.max(1) && (n == 0 || start.elapsed() < budget.min_time) {
            self.copy(size);
            n += 1;
        }
        (size * n) as f64 / start.elapsed().as_secs_f64().max(1e-9) / 1e9
    }
}

/// A [`Memcpy`] that concurrent measurement closures share (one at a time copies).
#[derive(Debug)]
pub struct SharedMemcpy(std::sync::Mutex<Memcpy>);

impl SharedMemcpy {
    /// Allocates and touches both buffers of `max` bytes.
    pub fn new(max: u64) -> SharedMemcpy {
        SharedMemcpy(std::sync::Mutex::new(Memcpy::new(max)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memcpy> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`Memcpy::copy`].
    pub fn copy(&self, size: u64) {
        self.lock().copy(size);
    }

    /// [`Memcpy::gbps`].
    pub fn gbps(&self, size: u64, budget: crate::measure::Budget) -> f64 {
        self.lock().gbps(size, budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_buffers_start_on_a_page_and_the_destination_at_the_distance() {
        for d in [0, 16, 4095, 4096 + 5] {
            let mut m = Memcpy::with_distance(10_000, d);
            m.copy(300);
            let (src, dst) = m.ends(10_000);
            assert_eq!(src.as_ptr() as usize % 4096, 0);
            assert_eq!(dst.as_ptr() as usize % 4096, d % 4096);
            assert_eq!((src.len(), dst.len()), (10_000, 10_000));
            assert_eq!(&dst[..300], &src[..300]);
            assert!(dst[300..].iter().all(|&b| b == 2), "copied past the size");
        }
    }
}
