//! Errors cross into Python as the exception classes of `tensorwire.errors`, one per error kind
//! of the Rust crates. A failure is kept as (class name, message) while the GIL is released and
//! becomes a Python exception once it is held again.

use pyo3::prelude::*;
use pyo3::types::PyType;
use tensorwire_core::{Error, Missing};
use tensorwire_diffusion::{ConnectorError, LeaseEnd};
use tensorwire_orchestrator::OrchestratorError;
use tensorwire_store::StoreError;

/// A failure on its way to Python: the exception class (in `tensorwire.errors`) and the message.
#[derive(Debug)]
pub(crate) struct Failure {
    class: &'static str,
    message: String,
}

/// Result of binding code that may run without the GIL.
pub(crate) type Res<T> = Result<T, Failure>;

impl Failure {
    pub(crate) fn new(class: &'static str, message: impl Into<String>) -> Failure {
        Failure { class, message: message.into() }
    }

    /// An argument that can never be valid.
    pub(crate) fn invalid(message: impl Into<String>) -> Failure {
        Failure::new("InvalidArgumentError", message)
    }

    /// The same failure, its message after `what: `.
    pub(crate) fn prefixed(self, what: &str) -> Failure {
        Failure { class: self.class, message: format!("{what}: {}", self.message) }
    }

    /// The Python exception.
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        let class = py
            .import("tensorwire.errors")
            .and_then(|m| m.getattr(self.class))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(c) => PyErr::from_type(c, self.message),
            Err(e) => e,
        }
    }
}

/// Turns a binding result into a Python one.
pub(crate) trait Raise<T> {
    fn raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> Raise<T> for Res<T> {
    fn raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|f| f.into_py(py))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        let class = match &e {
            Error::NotFound(Missing::Peer(_)) => "PeerNotFoundError",
            Error::NotFound(_) => "NotFoundError",
            Error::Unsupported { .. } => "UnsupportedError",
            Error::OutOfBounds { .. } => "OutOfBoundsError",
            Error::AccessDenied(_) => "AccessDeniedError",
            Error::PeerClosed(_) => "PeerClosedError",
            Error::Timeout { .. } => "TimeoutError",
            Error::Capacity { .. } => "CapacityError",
            Error::InvalidTensor(_) => "InvalidTensorError",
            Error::Checksum { .. } => "ChecksumError",
            Error::Protocol(_) => "ProtocolError",
            Error::InvalidArgument(_) => "InvalidArgumentError",
            Error::Backend { .. } => "BackendError",
            _ => "InternalError",
        };
        Failure::new(class, e.to_string())
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Failure {
        let class = match &e {
            StoreError::NotFound { .. } => "KeyNotFoundError",
            StoreError::Exists { .. } => "KeyExistsError",
            StoreError::InvalidArgument(_) => "InvalidArgumentError",
            StoreError::InvalidTensor(_) => "InvalidTensorError",
            StoreError::Capacity { .. } => "CapacityError",
            StoreError::Corrupt(_) => "CorruptError",
            StoreError::Io { .. } => "StoreIoError",
            StoreError::Engine(inner) => return inner.clone().into(),
            _ => "InternalError",
        };
        Failure::new(class, e.to_string())
    }
}

impl From<ConnectorError> for Failure {
    fn from(e: ConnectorError) -> Failure {
        let class = match &e {
            ConnectorError::Missing { .. } => "PayloadMissingError",
            ConnectorError::LeaseEnded { end: LeaseEnd::Consumed, .. } => "LeaseConsumedError",
            ConnectorError::LeaseEnded { .. } => "LeaseExpiredError",
            ConnectorError::Mismatch(_) => "MismatchError",
            ConnectorError::InvalidTensor(_) => "InvalidTensorError",
            ConnectorError::DestinationTooSmall { .. } => "DestinationTooSmallError",
            ConnectorError::Checksum { .. } => "ChecksumError",
            ConnectorError::ProducerGone(_) => "ProducerGoneError",
            ConnectorError::Timeout { .. } => "TimeoutError",
            ConnectorError::InvalidArgument(_) => "InvalidArgumentError",
            ConnectorError::Store(s) => return s.clone().into(),
            ConnectorError::Transport(t) => return t.clone().into(),
            _ => "InternalError",
        };
        Failure::new(class, e.to_string())
    }
}

impl From<OrchestratorError> for Failure {
    fn from(e: OrchestratorError) -> Failure {
        let class = match &e {
            OrchestratorError::Stopped => "StoppedError",
            OrchestratorError::Refused(_) => "RefusedError",
            OrchestratorError::Failed { .. } => "RequestFailedError",
            OrchestratorError::InvalidArgument(_) => "InvalidArgumentError",
            OrchestratorError::Transport(t) => return t.clone().into(),
            _ => "InternalError",
        };
        Failure::new(class, e.to_string())
    }
}
