//! The CPU copy every memory-to-memory backend uses (in-process, shared memory): segment by
//! segment, each inside the op's [`CancelGate`], yielding between segments so one large copy
//! never monopolises a runtime worker, and checking that both ends are still up before each.

use crate::cancel::CancelGate;
use crate::error::Result;

/// Bytes copied between cancellation and liveness checks (a cancel waits at most one segment's
/// copy, about 2 ms at memory speed).
pub const SEGMENT: u64 = 16 << 20;
/// Copies at least this large use non-temporal stores (x86_64): they do not pull the destination
/// through the cache, which is what makes a large memcpy run at memory bandwidth.
pub(crate) const STREAM_THRESHOLD: usize = 16 << 20;

/// How a [`gated_copy`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copied {
    /// Every byte was copied.
    All,
    /// The gate was cancelled; an unknown prefix was copied.
    Cancelled,
}

/// Copies `len` bytes from address `src` to address `dst` (overlap allowed).
///
/// # Safety
/// `[src, src+len)` must stay readable and `[dst, dst+len)` writable until the returned future
/// completes or is dropped (holding the `MemSlice`s or mappings they belong to is the usual way).
pub async unsafe fn gated_copy(
    src: usize,
    dst: usize,
    len: u64,
    gate: &CancelGate,
    alive: impl Fn() -> Result<()>,
) -> Result<Copied> {
    let cpu = |s: usize, d: usize, n: usize| {
        // SAFETY: `gated_copy_with` passes sub-ranges of the caller's ranges, which this
        // function's contract keeps valid.
        unsafe { copy_bytes(s, d, n) };
        Ok(())
    };
    // SAFETY: forwarded contract.
    unsafe { gated_copy_with(src, dst, len, SEGMENT, gate, alive, cpu) }.await
}

/// [`gated_copy`] with another copier for each segment of `segment` bytes (a device copy for
/// memory the CPU cannot reach): `copy(src, dst, n)` must have moved all `n` bytes when it
/// returns, so that a cancel, which waits for the segment in progress, leaves none in flight.
///
/// # Safety
/// As [`gated_copy`]; `copy` is only called on sub-ranges of the two ranges.
pub async unsafe fn gated_copy_with(
    src: usize,
    dst: usize,
    len: u64,
    segment: u64,
    gate: &CancelGate,
    alive: impl Fn() -> Result<()>,
    copy: impl Fn(usize, usize, usize) -> Result<()>,
) -> Result<Copied> {
    let copy = &copy;
    by_segments(len, segment, alive, |at, n| async move {
        match gate.run(|| copy(src + at, dst + at, n)) {
            None => return Ok(Copied::Cancelled),
            Some(r) => r?,
        }
        if ((at + n) as u64) < len {
            tokio::task::yield_now().await;
        }
        Ok(Copied::All)
    })
    .await
}

/// The segment loop of the gated copies: `step(at, n)` for each segment of at most `segment`
/// bytes of `len`, in order, with `alive()` checked before each; a step that says
/// [`Copied::Cancelled`] ends it. For copiers that [`gated_copy_with`] cannot call in place
/// (one that blocks its thread for a DMA runs each step on a blocking thread).
pub async fn by_segments<F, Fut>(
    len: u64,
    segment: u64,
    alive: impl Fn() -> Result<()>,
    mut step: F,
) -> Result<Copied>
where
    F: FnMut(usize, usize) -> Fut,
    Fut: std::future::Future<Output = Result<Copied>>,
{
    let mut done = 0u64;
    while done < len {
        alive()?;
        let n = segment.max(1).min(len - done);
        if step(done as usize, n as usize).await? == Copied::Cancelled {
            return Ok(Copied::Cancelled);
        }
        done += n;
    }
    Ok(Copied::All)
}

/// Copies `n` bytes from `src` to `dst`: `ptr::copy` (overlap-safe) for small or overlapping
/// ranges, non-temporal stores for large disjoint ones, and a vector loop of our own where the
/// C library's copy is known to crawl (a destination 1-63 bytes past the source modulo a page, on
/// AMD CPUs: see `page_aliased`).
///
/// # Safety
/// `[src, src+n)` readable and `[dst, dst+n)` writable for the duration of the call.
pub unsafe fn copy_bytes(src: usize, dst: usize, n: usize) {
    let disjoint = src.checked_add(n).is_some_and(|e| e <= dst)
        || dst.checked_add(n).is_some_and(|e| e <= src);
    #[cfg(target_arch = "x86_64")]
    if disjoint && (n >= STREAM_THRESHOLD || page_aliased(src, dst, n)) {
        // SAFETY: forwarded contract; the ranges do not overlap.
        unsafe { vector_copy(src as *const u8, dst as *mut u8, n, n >= STREAM_THRESHOLD) };
        return;
    }
    let _ = disjoint;
    // SAFETY: forwarded contract; `ptr::copy` tolerates overlap (an engine may address its own
    // region).
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) }
}

/// Copies of more than this many bytes, and below [`ALIASED_MAX`], go through `rep movsb` in
/// glibc's memcpy on CPUs with ERMS (the threshold is 2 KiB for 16-byte vectors, more for wider
/// ones; here a 2 KiB copy was fast at every distance and a 3,000-byte one slow).
#[cfg(target_arch = "x86_64")]
const ALIASED_ABOVE: usize = 2 << 10;
/// glibc stops using `rep movsb` at the L2 cache's size on AMD CPUs (512 KiB on Zen 3, 1 MiB
/// on Zen 4 and 5): no copy this large is slow at any distance.
#[cfg(target_arch = "x86_64")]
const ALIASED_MAX: usize = 1 << 20;

/// Whether glibc's memcpy would copy these bytes with `rep movsb` at a destination 1 to 63 bytes
/// past the source modulo a 4 KiB page, the case AMD's CPUs run at about 3 GB/s instead of
/// 30-80. Measured on this project's development machine (an AMD EPYC, glibc 2.36): a 64 KiB
/// copy at 2.4-3.0 GB/s at every distance from 1 to 31 and some up to 63, against 47 GB/s
/// through [`vector_copy`] (`xfer --copy` measures both). A buffer from `malloc` starts 16 bytes
/// into its page and a registered region or a shared mapping at 0, so a READ into such a
/// buffer is the slow case.
#[cfg(target_arch = "x86_64")]
fn page_aliased(src: usize, dst: usize, n: usize) -> bool {
    n > ALIASED_ABOVE && n < ALIASED_MAX && (1..64).contains(&(dst.wrapping_sub(src) % 4096))
}

/// SSE2 (part of the x86_64 baseline) copy of 64 bytes per step, stored at aligned addresses of
/// `dst`: with streaming (non-temporal) stores when `stream`, else plain ones. A streaming copy
/// walks four pages at once (a line of each in turn): from memory, the reads of four streams
/// keep more lines in flight than one. Measured on an Intel Xeon (C, 16 MiB calls, as the
/// memory backends' segments): 11.4-12.9 GB/s at 256 MiB and 1 GiB against 9.7-10.8 for one
/// stream and 7.2-7.8 for memcpy.
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes; the ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn vector_copy(src: *const u8, dst: *mut u8, n: usize, stream: bool) {
    use std::arch::x86_64::_mm_sfence;
    // Streaming stores fill whole lines: start them on one.
    let head = dst.align_offset(if stream { 64 } else { 16 }).min(n);
    // SAFETY: the caller's contract covers every access below: offsets stay below `n`, the head
    // and tail use a plain copy, and the vector stores hit 16-byte-aligned addresses of `dst`
    // (aligned by the head). The sfence orders streaming stores before later plain stores
    // (such as the completion that publishes the bytes).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        if stream {
            while i + STRIDE * 4 <= n {
                for line in (0..STRIDE).step_by(64) {
                    for page in 0..4 {
                        let at = i + page * STRIDE + line;
                        copy_line(src.add(at), dst.add(at), true);
                    }
                }
                i += STRIDE * 4;
            }
        }
        while i + 64 <= n {
            copy_line(src.add(i), dst.add(i), stream);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
        if stream {
            _mm_sfence();
        }
    }
}

/// The distance between the four streams of a streaming copy: a page.
#[cfg(target_arch = "x86_64")]
const STRIDE: usize = 4096;

/// Copies 64 bytes from `src` to `dst` with four 16-byte loads and stores.
///
/// # Safety
/// `src` readable and `dst` writable for 64 bytes, `dst` 16-byte aligned; no overlap.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn copy_line(src: *const u8, dst: *mut u8, stream: bool) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_store_si128, _mm_stream_si128};
    let (s, d) = (src.cast::<__m128i>(), dst.cast::<__m128i>());
    // SAFETY: forwarded contract: four 16-byte reads of `src` and aligned writes of `dst`.
    unsafe {
        let v = [
            _mm_loadu_si128(s),
            _mm_loadu_si128(s.add(1)),
            _mm_loadu_si128(s.add(2)),
            _mm_loadu_si128(s.add(3)),
        ];
        for (k, v) in v.into_iter().enumerate() {
            match stream {
                true => _mm_stream_si128(d.add(k), v),
                false => _mm_store_si128(d.add(k), v),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both buffers page-aligned plus `d` bytes for the destination: the distances the C library
    /// copies slowly take the vector loop, and every one copies exactly.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn copies_exactly_at_the_page_distances_the_c_library_copies_slowly() {
        const PAGE: usize = 4096;
        let most = 70_000;
        let src: Vec<u8> = (0..most + PAGE).map(|i| (i * 7 % 253) as u8).collect();
        let s = src.as_ptr().align_offset(PAGE);
        for d in [0, 1, 15, 16, 31, 48, 63, 64, 100, PAGE - 1] {
            for n in [ALIASED_ABOVE, ALIASED_ABOVE + 1, PAGE + 13, 65_536] {
                let mut dst = vec![0u8; most + 2 * PAGE];
                let at = dst.as_ptr().align_offset(PAGE) + d;
                let (from, to) = (src.as_ptr() as usize + s, dst.as_mut_ptr() as usize + at);
                let slow = (1..64).contains(&d) && n > ALIASED_ABOVE;
                assert_eq!(page_aliased(from, to, n), slow, "distance {d}, {n} bytes");
                // SAFETY: `src` holds `s + n` bytes and `dst` holds `at + n`; they do not overlap.
                unsafe { copy_bytes(from, to, n) };
                assert_eq!(&dst[at..at + n], &src[s..s + n], "distance {d}, {n} bytes");
                assert!(dst[..at].iter().chain(&dst[at + n..]).all(|&b| b == 0));
            }
        }
        assert!(!page_aliased(0, 16, ALIASED_MAX), "a copy of the L2's size is fast");
        assert!(page_aliased(PAGE, 16, ALIASED_MAX - 1), "distance is modulo a page");
    }

    #[test]
    fn copies_exactly_at_every_alignment_and_size() {
        let src: Vec<u8> = (0..(STREAM_THRESHOLD + 300)).map(|i| (i * 31 % 251) as u8).collect();
        for (off_s, off_d, n) in
            [(0, 0, STREAM_THRESHOLD), (3, 7, STREAM_THRESHOLD + 97), (1, 0, 100)]
        {
            let mut dst = vec![0u8; STREAM_THRESHOLD + 300];
            // SAFETY: both vectors hold `off + n` bytes and do not overlap.
            unsafe {
                copy_bytes(src.as_ptr() as usize + off_s, dst.as_mut_ptr() as usize + off_d, n)
            };
            assert_eq!(&dst[off_d..off_d + n], &src[off_s..off_s + n]);
            assert!(dst[..off_d].iter().all(|&b| b == 0));
            assert!(dst[off_d + n..].iter().all(|&b| b == 0));
        }
        // Overlapping ranges fall back to memmove semantics.
        let mut buf: Vec<u8> = (0..(STREAM_THRESHOLD + 64)).map(|i| i as u8).collect();
        let want: Vec<u8> = buf[..STREAM_THRESHOLD].to_vec();
        let base = buf.as_mut_ptr() as usize;
        // SAFETY: both ranges lie inside `buf`.
        unsafe { copy_bytes(base, base + 64, STREAM_THRESHOLD) };
        assert_eq!(&buf[64..], &want[..]);
    }
}
