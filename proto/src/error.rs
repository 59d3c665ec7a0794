//! The transport's error type. Callers branch on its variants; backends map their private errors
//! into it (usually [`Error::Backend`]). The layers above (store, connector, orchestrator) have
//! their own enums that wrap it where a transport error is the cause.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::ids::RegionId;

/// Result with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What was looked up and not found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Missing {
    /// A region id that was never registered on the engine that was asked.
    Region(RegionId),
    /// A region that existed but has been deregistered.
    Deregistered(RegionId),
    /// A peer engine (by id or address) this engine has no session with.
    Peer(String),
    /// A chunked transfer id the receiver is not expecting.
    Transfer(u64),
    /// Anything else, described.
    Other(String),
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Region(id) => write!(f, "region {} was never registered", id.0),
            Missing::Deregistered(id) => write!(f, "region {} has been deregistered", id.0),
            Missing::Peer(p) => write!(f, "peer {p}"),
            Missing::Transfer(t) => write!(f, "chunked transfer {t:#x} is not expected here"),
            Missing::Other(s) => f.write_str(s),
        }
    }
}

/// Every error tensorwire reports. Messages name what failed and the numbers involved.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Something looked up does not exist (or no longer exists).
    #[error("not found: {0}")]
    NotFound(Missing),
    /// The backend (or the engine, when no backend fits) cannot do what was asked.
    #[error("{backend}: unsupported: {what}")]
    Unsupported {
        /// Backend name, or "engine".
        backend: &'static str,
        /// What was asked.
        what: String,
    },
    /// An offset and length fall outside the memory they address.
    #[error("{what}: offset {offset} + len {len} exceeds length {limit}")]
    OutOfBounds {
        /// The memory addressed, e.g. "remote region 7".
        what: String,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Length of the memory.
        limit: u64,
    },
    /// Wrong access key, or a permission the region does not grant, or a peer that failed authentication.
    #[error("access denied: {0}")]
    AccessDenied(String),
    /// The peer went away (connection closed, engine shut down) before the operation completed.
    #[error("peer closed: {0}")]
    PeerClosed(String),
    /// A wait ran past its configured bound.
    #[error("timed out after {after:?}: {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The bound that expired.
        after: Duration,
    },
    /// A bounded resource (queue, pool, frame size) is full or too small.
    #[error("capacity: {what}: requested {requested}, limit {limit}")]
    Capacity {
        /// Which resource.
        what: String,
        /// What was requested.
        requested: u64,
        /// The bound.
        limit: u64,
    },
    /// A tensor description is malformed or does not fit its memory.
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// Bytes that arrived (or were stored) do not match their checksum: corrupted in flight or at rest.
    #[error("checksum mismatch: {what}: expected {expected:#010x}, computed {actual:#010x}")]
    Checksum {
        /// The bytes checked, e.g. "tcp READ of region 3 [0, 4096)".
        what: String,
        /// The checksum sent or stored with the bytes.
        expected: u32,
        /// The checksum of the bytes as received.
        actual: u32,
    },
    /// A malformed, truncated, oversized or unexpected frame or message from a peer.
    #[error("protocol: {0}")]
    Protocol(String),
    /// An invariant of tensorwire itself broke (a bug, never a peer's or a caller's doing).
    #[error("internal error (a tensorwire bug; please report it): {0}")]
    Internal(String),
    /// An argument that can never be valid (zero chunk count, a chunk index past the plan, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A backend's own failure, with its detailed error.
    #[error("{backend}: {source}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// The backend's error.
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// Every value [`Error::kind`] returns.
    pub const KINDS: &'static [&'static str] = &[
        "not_found",
        "unsupported",
        "out_of_bounds",
        "access_denied",
        "peer_closed",
        "timeout",
        "capacity",
        "invalid_tensor",
        "checksum",
        "protocol",
        "internal",
        "invalid_argument",
        "backend",
    ];

    /// The error's kind, as a metric label value (`tensorwire_transfer_errors_total{kind}`).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::NotFound(_) => "not_found",
            Error::Unsupported { .. } => "unsupported",
            Error::OutOfBounds { .. } => "out_of_bounds",
            Error::AccessDenied(_) => "access_denied",
            Error::PeerClosed(_) => "peer_closed",
            Error::Timeout { .. } => "timeout",
            Error::Capacity { .. } => "capacity",
            Error::InvalidTensor(_) => "invalid_tensor",
            Error::Checksum { .. } => "checksum",
            Error::Protocol(_) => "protocol",
            Error::Internal(_) => "internal",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::Backend { .. } => "backend",
        }
    }

    /// Shorthand for [`Error::Protocol`].
    pub fn protocol(msg: impl Into<String>) -> Self {
        Error::Protocol(msg.into())
    }

    /// Shorthand for [`Error::Timeout`].
    pub fn timeout(what: impl Into<String>, after: Duration) -> Self {
        Error::Timeout { what: what.into(), after }
    }

    /// True for the errors that mean "the peer is gone or unresponsive".
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, Error::PeerClosed(_) | Error::Timeout { .. })
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind::*;
        match e.kind() {
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof | NotConnected => {
                Error::PeerClosed(e.to_string())
            }
            TimedOut => Error::timeout(e.to_string(), Duration::ZERO),
            _ => Error::Backend { backend: "io", source: Arc::new(e) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_lists_the_kind_of_every_variant_once() {
        let s = String::new;
        let all = [
            Error::NotFound(Missing::Other(s())),
            Error::Unsupported { backend: "b", what: s() },
            Error::OutOfBounds { what: s(), offset: 0, len: 0, limit: 0 },
            Error::AccessDenied(s()),
            Error::PeerClosed(s()),
            Error::timeout("t", Duration::ZERO),
            Error::Capacity { what: s(), requested: 0, limit: 0 },
            Error::InvalidTensor(s()),
            Error::Checksum { what: s(), expected: 0, actual: 0 },
            Error::Protocol(s()),
            Error::Internal(s()),
            Error::InvalidArgument(s()),
            Error::Backend { backend: "b", source: Arc::new(std::io::Error::other("x")) },
        ];
        let kinds: Vec<&str> = all.iter().map(Error::kind).collect();
        assert_eq!(kinds, Error::KINDS);
    }
}
