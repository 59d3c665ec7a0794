//! A served connection's word that its server still serves it: one page of a sealed memfd. The
//! serving side makes one per accepted connection and passes it first (a `Live` frame); its
//! shutdown writes "closed" there before it hangs up and returns. The initiator maps the page
//! read-only and reads it (one load) before each op it copies in `submit`, where it used to ask
//! the kernel (a `poll(2)` of the stream: about 1 us, a third of a 64 KiB op). A peer that dies
//! without shutting down is seen by the connection's reader, at the end of its stream.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use tensorwire_core::{Error, Result};

use crate::medium::Opened;
use crate::memfd;

/// Bytes of the page (one page; only its first word is used).
const LEN: usize = 4096;
/// Seals the server sets before it shares the page: it can neither shrink (a reader would
/// fault) nor be mapped writable again.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE;

/// One mapping of a connection's live page.
#[derive(Debug)]
pub(crate) struct LivePage {
    word: NonNull<AtomicU32>,
    /// The mapping (unmapped when dropped).
    _map: Opened,
}

// SAFETY: the page is shared memory read and written only through the `AtomicU32` at its start.
unsafe impl Send for LivePage {}
// SAFETY: as above.
unsafe impl Sync for LivePage {}

impl LivePage {
    /// The serving side's page (writable, zero: open) and a descriptor for the peer, which
    /// can map it only read-only.
    pub(crate) fn create() -> Result<(LivePage, OwnedFd)> {
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // SAFETY: a NUL-terminated name; memfd_create has no other preconditions.
        let raw = unsafe { libc::memfd_create(c"tensorwire-shm-live".as_ptr(), flags) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on the memfd just made.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), LEN as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        let page = LivePage::map(&fd, true)?;
        // SAFETY: F_ADD_SEALS on the memfd made with MFD_ALLOW_SEALING; our own writable
        // mapping predates the seal and stays writable.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok((page, fd))
    }

    /// The initiator's mapping of the page a peer passed: refused unless sealed as
    /// [`LivePage::create`] seals it (a page the peer could shrink would fault our loads).
    pub(crate) fn open(fd: OwnedFd) -> Result<LivePage> {
        // SAFETY: F_GET_SEALS on an open descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(Error::protocol("shm: the peer's live page is not sealed"));
        }
        LivePage::map(&fd, false)
    }

    /// Maps the page of `fd` (refused when it holds less than a page).
    fn map(fd: &OwnedFd, writable: bool) -> Result<LivePage> {
        let map = memfd::map(fd, LEN as u64, writable)?;
        let word = NonNull::new(map.addr as *mut AtomicU32)
            .ok_or_else(|| Error::Internal("mmap returned a null mapping".into()))?;
        Ok(LivePage { word, _map: map })
    }

    /// Says the connection is no longer served (the serving side, before it hangs up).
    pub(crate) fn close(&self) {
        // SAFETY: the word lies in this value's live mapping.
        unsafe { self.word.as_ref() }.store(1, Ordering::Release);
    }

    /// Whether the serving side closed the connection.
    pub(crate) fn closed(&self) -> bool {
        // SAFETY: the word lies in this value's live mapping.
        unsafe { self.word.as_ref() }.load(Ordering::Acquire) != 0
    }
}

/// A page-long memfd with no seals (what a peer that could shrink it would pass).
#[cfg(test)]
pub(crate) fn unsealed_page() -> OwnedFd {
    // SAFETY: a NUL-terminated name.
    let raw = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create");
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate on it.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), LEN as libc::off_t) }, 0);
    fd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_sees_the_close_and_cannot_write_the_page() {
        let (server, fd) = LivePage::create().unwrap();
        // SAFETY: F_DUPFD_CLOEXEC on an open descriptor.
        let dup =
            unsafe { OwnedFd::from_raw_fd(libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0)) };
        let client = LivePage::open(fd).unwrap();
        assert!(!client.closed());
        server.close();
        assert!(client.closed());
        let w = memfd::map(&dup, LEN as u64, true);
        assert!(w.is_err(), "a writable mapping of the sealed page");
    }

    #[test]
    fn an_unsealed_page_is_refused() {
        let e = LivePage::open(unsealed_page()).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
    }
}
