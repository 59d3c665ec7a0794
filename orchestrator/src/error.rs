//! The orchestrator's errors, wrapping the transport's where the network underneath is the cause.

/// Result with [`OrchestratorError`].
pub type Result<T, E = OrchestratorError> = std::result::Result<T, E>;

/// Every error the orchestrator, its service and its clients report.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum OrchestratorError {
    /// The orchestrator (its task, or the service's connection) is gone.
    #[error("orchestrator stopped")]
    Stopped,
    /// The service refused the client (authentication, role) or a message.
    #[error("orchestrator refused: {0}")]
    Refused(String),
    /// A request failed: every try of one of its stages failed.
    #[error("request {request} failed: {reason}")]
    Failed {
        /// The request.
        request: u64,
        /// The scheduler's account (stage, tries, last error).
        reason: String,
    },
    /// An argument that can never be valid (outputs too large for a message).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The network underneath (connect, handshake, a malformed message, a timeout).
    #[error(transparent)]
    Transport(#[from] tensorwire_core::Error),
    /// An invariant broke (a bug, please report it).
    #[error("orchestrator internal error (a tensorwire bug; please report it): {0}")]
    Internal(String),
}
