//! The connector's errors: one variant per thing a stage worker branches on, with the store's and
//! the engine's errors wrapped where they are the cause.

use std::time::Duration;

use tensorwire_store::StoreError;

/// Result with [`ConnectorError`].
pub type Result<T, E = ConnectorError> = std::result::Result<T, E>;

/// Why a lease no longer serves its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEnd {
    /// Every expected consumer already consumed it.
    Consumed,
    /// Its time ran out.
    Expired,
}

/// Every error the connector reports.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    /// The payload is not there: never published (or not yet, within the wait), or gone from the
    /// store.
    #[error("payload {payload} not found: {why}")]
    Missing {
        /// The payload (producer payload id or store key).
        payload: String,
        /// What was looked at.
        why: String,
    },
    /// The payload's lease ended before this consumer got it.
    #[error("payload {payload}: lease ended ({end:?})")]
    LeaseEnded {
        /// The payload.
        payload: String,
        /// Consumed or expired.
        end: LeaseEnd,
    },
    /// The payload is not the tensor the consumer expects (dtype or shape).
    #[error("payload mismatch: {0}")]
    Mismatch(String),
    /// The tensor's layout cannot be handed off as asked (an unchunked payload that is not
    /// contiguous, a chunk dimension whose inner dimensions are not dense).
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// The destination cannot hold the payload.
    #[error("destination region {region}: offset {offset} + {needed} bytes exceeds its {len}")]
    DestinationTooSmall {
        /// Destination region id.
        region: u64,
        /// Offset asked for.
        offset: u64,
        /// Bytes the payload needs.
        needed: u64,
        /// Region length.
        len: u64,
    },
    /// Bytes arrived that do not match the checksum the producer computed.
    #[error("checksum mismatch: {what}: expected {expected:#010x}, computed {actual:#010x}")]
    Checksum {
        /// What was checked.
        what: String,
        /// The producer's checksum.
        expected: u32,
        /// The consumer's.
        actual: u32,
    },
    /// The producer is gone: it died, stopped answering, retired or abandoned the payload.
    #[error("producer gone: {0}")]
    ProducerGone(String),
    /// A wait ran past the connector's bound.
    #[error("timed out after {after:?}: {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The bound.
        after: Duration,
    },
    /// An argument that can never be valid (a chunk marked twice, an index past the plan, a
    /// store-mode payload without a store, a p2p region peers cannot read).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The store underneath failed.
    #[error(transparent)]
    Store(StoreError),
    /// The engine underneath failed (a transfer, registered memory, the network).
    #[error(transparent)]
    Transport(tensorwire_core::Error),
    /// An invariant of the connector broke (a bug, please report it).
    #[error("connector internal error (a tensorwire bug; please report it): {0}")]
    Internal(String),
}

impl From<tensorwire_core::Error> for ConnectorError {
    fn from(e: tensorwire_core::Error) -> Self {
        ConnectorError::Transport(e)
    }
}

impl From<StoreError> for ConnectorError {
    fn from(e: StoreError) -> Self {
        ConnectorError::Store(e)
    }
}

impl ConnectorError {
    /// The payload is gone for good (its producer died, its lease ended, the store does not
    /// have it): retrying the consume cannot help, only producing it again can.
    pub fn is_payload_lost(&self) -> bool {
        matches!(
            self,
            ConnectorError::ProducerGone(_)
                | ConnectorError::Missing { .. }
                | ConnectorError::LeaseEnded { .. }
                | ConnectorError::Store(StoreError::NotFound { .. })
        )
    }

    /// A transfer from the producer failed: a dead or unresponsive producer is
    /// [`ConnectorError::ProducerGone`], anything else stays a transport error.
    pub(crate) fn from_producer(e: tensorwire_core::Error) -> Self {
        if e.is_peer_failure() {
            ConnectorError::ProducerGone(e.to_string())
        } else {
            ConnectorError::Transport(e)
        }
    }
}
