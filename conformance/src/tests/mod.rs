//! The suite's test functions, grouped by concern.

mod batch;
mod chunked;
mod lifecycle;
mod notify;
mod prepared;
mod rejection;
mod roundtrip;

pub use batch::*;
pub use chunked::*;
pub use lifecycle::*;
pub use notify::*;
pub use prepared::*;
pub use rejection::*;
pub use roundtrip::*;
