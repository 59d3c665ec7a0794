//! The simulator's error: what went wrong for the person who ran it (a profile that does not
//! parse, a layout that cannot serve a stage, a phase list or a mix written wrong).

use std::fmt;

/// What went wrong, as a message for the person who ran the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<String> for Error {
    fn from(s: String) -> Error {
        Error(s)
    }
}

impl From<&str> for Error {
    fn from(s: &str) -> Error {
        Error(s.to_string())
    }
}

/// A result with the simulator's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
