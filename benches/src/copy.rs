//! `xfer --copy`: the CPU copy every memory-to-memory backend makes (`copy_bytes`: shm, mem, the
//! UCX mapped path, region to region), against the C library's memcpy of the same bytes at the
//! same distance between the two buffers' page offsets, interleaved; the bound is memcpy between
//! page-aligned buffers (distance 0), measured in the same run.
//!
//! The distance matters on AMD CPUs: glibc's memcpy copies 2 KiB to 1 MiB with `rep movsb`,
//! which crawls when the destination is 1 to 63 bytes past the source modulo a page. A READ
//! into a `malloc`ed buffer (16 bytes into its page) from a registered region or a shared
//! mapping (page-aligned) is that case.

use crate::Result;
use crate::measure::{Budget, interleaved};
use crate::memcpy::Memcpy;
use crate::report::Line;

/// One line per (distance, size): tensorwire's copy against memcpy at that distance.
pub async fn run(
    sizes: &[u64],
    distances: &[usize],
    runs: usize,
    budget: Budget,
    on_line: &(dyn Fn(&Line) + Sync),
) -> Result<Vec<Line>> {
    let max = sizes.iter().copied().max().unwrap_or(4096);
    let mut aligned = Memcpy::new(max);
    let mut lines = Vec::new();
    for &distance in distances {
        eprintln!("  the destination {distance} bytes further into its page than the source:");
        let (ours, theirs) = (
            std::sync::Mutex::new(Memcpy::with_distance(max, distance)),
            std::sync::Mutex::new(Memcpy::with_distance(max, distance)),
        );
        for &size in sizes {
            let tw = || async {
                let mut m = ours.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let (src, dst) = m.ends(size);
                // SAFETY: both slices are live for the call and belong to different buffers.
                unsafe {
                    tensorwire_core::backend::kit::copy_bytes(
                        src.as_ptr() as usize,
                        dst.as_mut_ptr() as usize,
                        src.len(),
                    )
                };
                std::hint::black_box(dst);
                Ok(())
            };
            let libc = || async {
                theirs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).copy(size);
                Ok(())
            };
            let (a, b) = interleaved(runs, budget, size, tw, libc).await?;
            let name = format!("copy-distance-{distance}");
            let line = Line::from_samples(&name, "copy", size, 1, "memcpy", a, b)
                .bounded(1, aligned.gbps(size, budget));
            on_line(&line);
            lines.push(line);
        }
    }
    Ok(lines)
}
