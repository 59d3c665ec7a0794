//! Positioned file I/O through io_uring when the kernel allows it (probed once; containers often
//! forbid it), plain `pwrite`/`pread` otherwise. One small ring per spill tier, used under a lock:
//! each call submits one operation and waits for it, looping over short transfers.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use io_uring::{IoUring, opcode, types};

/// A file I/O path: io_uring if available, else positioned syscalls.
pub(crate) struct FileIo {
    ring: Option<Mutex<IoUring>>,
}

impl std::fmt::Debug for FileIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.ring.is_some() { "FileIo(io_uring)" } else { "FileIo(pread/pwrite)" })
    }
}

impl FileIo {
    /// Probes io_uring.
    pub(crate) fn new() -> FileIo {
        FileIo { ring: IoUring::new(8).ok().map(Mutex::new) }
    }

    /// Whether io_uring is in use.
    pub(crate) fn uring(&self) -> bool {
        self.ring.is_some()
    }

    fn run(&self, ring: &Mutex<IoUring>, e: io_uring::squeue::Entry) -> io::Result<usize> {
        let mut ring = ring.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: the entry's buffer (built by the callers below from a live slice) stays valid
        // until this call returns, and we wait for its completion before returning.
        unsafe { ring.submission().push(&e) }
            .map_err(|_| io::Error::other("io_uring queue full"))?;
        ring.submit_and_wait(1)?;
        let cqe =
            ring.completion().next().ok_or_else(|| io::Error::other("io_uring: no completion"))?;
        let r = cqe.result();
        if r < 0 { Err(io::Error::from_raw_os_error(-r)) } else { Ok(r as usize) }
    }

    /// Writes all of `buf` at `offset`.
    pub(crate) fn write_all_at(&self, f: &File, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
        let Some(ring) = &self.ring else { return f.write_all_at(buf, offset) };
        while !buf.is_empty() {
            let n = buf.len().min(1 << 30) as u32;
            let e = opcode::Write::new(types::Fd(f.as_raw_fd()), buf.as_ptr(), n)
                .offset(offset)
                .build();
            let done = self.run(ring, e)?;
            if done == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "io_uring wrote nothing"));
            }
            buf = &buf[done..];
            offset += done as u64;
        }
        Ok(())
    }

    /// Fills `buf` from `offset`; a file that ends first is `UnexpectedEof`.
    pub(crate) fn read_exact_at(&self, f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // SAFETY: `buf` is `buf.len()` writable bytes, borrowed for the call.
        unsafe { self.read_exact_at_ptr(f, buf.as_mut_ptr(), buf.len(), offset) }
    }

    /// Fills `len` bytes at `ptr` from `offset`, writing through the pointer only (the kernel
    /// writes the memory as a NIC would; no reference to it is formed).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be writable memory that stays valid during the call.
    pub(crate) unsafe fn read_exact_at_ptr(
        &self,
        f: &File,
        ptr: *mut u8,
        len: usize,
        mut offset: u64,
    ) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(1 << 30);
            // SAFETY: `done + n <= len`, inside the caller's range.
            let at = unsafe { ptr.add(done) };
            let got = match &self.ring {
                Some(ring) => {
                    let e = opcode::Read::new(types::Fd(f.as_raw_fd()), at, n as u32)
                        .offset(offset)
                        .build();
                    self.run(ring, e)?
                }
                None => {
                    let off = libc::off_t::try_from(offset)
                        .map_err(|_| io::Error::other("file offset past off_t"))?;
                    // SAFETY: `at` is `n` writable bytes (above); the result is checked.
                    let r = unsafe { libc::pread(f.as_raw_fd(), at.cast(), n, off) };
                    if r < 0 {
                        let e = io::Error::last_os_error();
                        if e.kind() == io::ErrorKind::Interrupted {
                            continue;
                        }
                        return Err(e);
                    }
                    r as usize
                }
            };
            if got == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file ends early"));
            }
            done += got;
            offset += got as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_short_file() {
        let io = FileIo::new();
        let path = std::env::temp_dir().join(format!("tw-uring-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        io.write_all_at(&f, &data, 10).unwrap();
        let mut back = vec![0u8; data.len()];
        io.read_exact_at(&f, &mut back, 10).unwrap();
        assert_eq!(back, data);
        let mut past = vec![0u8; 10];
        let e = io.read_exact_at(&f, &mut past, 100_005).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let _ = std::fs::remove_file(&path);
    }
}
