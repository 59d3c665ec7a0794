//! The memcpy baseline: one copy of the same bytes between two buffers of this process.

use std::time::Instant;

/// Two page-touched buffers of `max` bytes.
#[derive(Debug)]
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    /// Allocates and touches both buffers.
    pub fn new(max: u64) -> Memcpy {
        let n = usize::try_from(max).unwrap_or(usize::MAX);
        Memcpy { src: vec![1u8; n], dst: vec![2u8; n] }
    }

    /// Copies `size` bytes once.
    pub fn copy(&mut self, size: u64) {
        let n = (size as usize).min(self.src.len());
        self.dst[..n].copy_from_slice(&self.src[..n]);
        std::hint::black_box(&mut self.dst);
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
