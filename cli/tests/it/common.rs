//! Helpers the CLI's tests share.

use std::net::SocketAddr;
use std::process::Child;

/// A child process, killed and reaped when dropped.
pub(crate) struct Kill(pub(crate) Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback address with a port that was free a moment ago.
pub(crate) fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}
