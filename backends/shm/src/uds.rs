//! Frames over a tokio `UnixStream`, with file descriptors attached via `SCM_RIGHTS`. Writers of a
//! stream serialise through [`FrameWriter`]; one task reads through [`FrameReader`], which keeps
//! the descriptors that arrived in order and hands one to each header that says it carries one.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use tensorwire_core::{Error, Result};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::wire::{HAS_FD, HEADER_LEN, Header};

/// Most descriptors queued before their headers are read (a peer sending more is broken).
const MAX_QUEUED_FDS: usize = 16;
/// Bytes read per `recvmsg`.
const READ_CHUNK: usize = 64 << 10;

/// Serialised writes of whole frames to one stream.
#[derive(Debug)]
pub(crate) struct FrameWriter {
    sock: Arc<UnixStream>,
    lock: tokio::sync::Mutex<()>,
}

impl FrameWriter {
    pub(crate) fn new(sock: Arc<UnixStream>) -> Self {
        FrameWriter { sock, lock: tokio::sync::Mutex::new(()) }
    }

    /// Shuts the stream down both ways now (the peer sees it at once, before any task of ours
    /// that still holds the stream is gone).
    pub(crate) fn hang_up(&self) {
        // SAFETY: shutdown(2) on the open descriptor this writer's stream owns; no memory is
        // passed.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
    }

    /// Sends `h`, then `body`, with `fd` attached to the first byte.
    pub(crate) async fn send(&self, h: &Header, body: &[u8], fd: Option<RawFd>) -> Result<()> {
        let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
        frame.extend_from_slice(&h.encode());
        frame.extend_from_slice(body);
        let _g = self.lock.lock().await;
        let mut sent = 0usize;
        let mut fd = fd;
        while sent < frame.len() {
            let r = self
                .sock
                .try_io(Interest::WRITABLE, || send_with_fd(&self.sock, &frame[sent..], fd));
            match r {
                Ok(n) => {
                    sent += n;
                    fd = None; // the descriptor went with the first bytes
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.sock.writable().await?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Room for one descriptor's control message.
#[repr(C)]
union CmsgSpace {
    hdr: libc::cmsghdr,
    buf: [u8; 64],
}

fn send_with_fd(sock: &UnixStream, bytes: &[u8], fd: Option<RawFd>) -> std::io::Result<usize> {
    let mut iov =
        libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut space = CmsgSpace { buf: [0; 64] };
    // SAFETY: a zeroed msghdr is valid (no name, no control data until set below).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE/CMSG_LEN are pure size computations; `space` is 64 bytes, more than
        // CMSG_SPACE(4), and aligned for cmsghdr by the union; CMSG_FIRSTHDR of a msghdr whose
        // control buffer is that space is non-null and points into it.
        unsafe {
            msg.msg_control = (&raw mut space).cast();
            msg.msg_controllen = libc::CMSG_SPACE(size_of::<RawFd>() as u32) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    // SAFETY: the socket fd is open (owned by `sock`); `msg` points at live locals.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Reads frames and the descriptors that come with them.
#[derive(Debug)]
pub(crate) struct FrameReader {
    sock: Arc<UnixStream>,
    buf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
}

/// One frame: header, body, and its descriptor if the header says it has one.
#[derive(Debug)]
pub(crate) struct Frame {
    pub(crate) h: Header,
    pub(crate) body: Vec<u8>,
    pub(crate) fd: Option<OwnedFd>,
}

impl FrameReader {
    pub(crate) fn new(sock: Arc<UnixStream>) -> Self {
        FrameReader { sock, buf: Vec::new(), fds: VecDeque::new() }
    }

    /// The next frame; `Ok(None)` at a clean end of stream between frames.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>> {
        loop {
            if self.buf.len() >= HEADER_LEN {
                let h = Header::decode(&self.buf[..HEADER_LEN])?;
                let total = HEADER_LEN + h.body_len() as usize; // bounded by decode
                if self.buf.len() >= total {
                    let body = self.buf[HEADER_LEN..total].to_vec();
                    self.buf.drain(..total);
                    let fd = if h.flags & HAS_FD != 0 {
                        Some(self.fds.pop_front().ok_or_else(|| {
                            Error::protocol("shm: a grant said it carries a descriptor; none came")
                        })?)
                    } else {
                        None
                    };
                    return Ok(Some(Frame { h, body, fd }));
                }
            }
            if !self.fill().await? {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(Error::PeerClosed("shm: stream ended inside a frame".into()))
                };
            }
        }
    }

    /// Reads more bytes; false at end of stream.
    async fn fill(&mut self) -> Result<bool> {
        let at = self.buf.len();
        self.buf.resize(at + READ_CHUNK, 0);
        let r = loop {
            let r = self
                .sock
                .try_io(Interest::READABLE, || recv_with_fds(&self.sock, &mut self.buf[at..]));
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Err(e) = self.sock.readable().await {
                        break Err(e);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                r => break r,
            }
        };
        match r {
            Ok((n, fds)) => {
                self.buf.truncate(at + n);
                self.fds.extend(fds);
                if self.fds.len() > MAX_QUEUED_FDS {
                    return Err(Error::protocol("shm: peer sent descriptors nobody asked for"));
                }
                Ok(n > 0)
            }
            Err(e) => {
                self.buf.truncate(at);
                Err(e.into())
            }
        }
    }
}

fn recv_with_fds(sock: &UnixStream, out: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: out.as_mut_ptr().cast(), iov_len: out.len() };
    let mut space = CmsgSpace { buf: [0; 64] };
    // SAFETY: a zeroed msghdr is valid; the fields set point at live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = (&raw mut space).cast();
    msg.msg_controllen = size_of::<CmsgSpace>() as _;
    // SAFETY: the socket fd is open; `msg` describes writable local buffers. MSG_CMSG_CLOEXEC
    // keeps received descriptors from leaking into child processes.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `space`, with the libc macros,
    // which stay within `msg_controllen`; SCM_RIGHTS data is an array of ints, read unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd)); // the kernel gave us this descriptor
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other("shm: control data truncated (descriptors lost)"));
    }
    Ok((n as usize, fds))
}
