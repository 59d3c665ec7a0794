//! Synchronisation primitives switch: std types normally, loom's under `cfg(loom)`, so the shared
//! counters, gates and fences of this crate can be model-checked
//! (`RUSTFLAGS="--cfg loom" cargo test -p tensorwire-core --release loom`). Internal to core.

#[cfg(loom)]
pub(crate) use loom::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, AtomicUsize, Ordering},
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, AtomicUsize, Ordering},
};

/// Locks a mutex, recovering the guard if a panicking thread poisoned it: the state behind every
/// mutex here stays consistent across a panic (each critical section is a single assignment or copy).
#[cfg(not(loom))]
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Locks a loom mutex (loom models never poison).
#[cfg(loom)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> loom::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Read-locks an `RwLock`, recovering from poisoning as [`lock`] does.
#[cfg(not(loom))]
pub(crate) fn read<T>(l: &std::sync::RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Write-locks an `RwLock`, recovering from poisoning as [`lock`] does.
#[cfg(not(loom))]
pub(crate) fn write<T>(l: &std::sync::RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}
