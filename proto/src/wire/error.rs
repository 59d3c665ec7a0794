//! Errors on the wire: a peer that refuses an op sends back the [`Error`] it hit, so the initiator
//! sees the same variant (and the same numbers) it would see in-process. Bounded and total: a
//! malformed error body decodes to [`Error::Protocol`], never a panic.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Missing, Result};
use crate::ids::RegionId;
use crate::wire::codec::{Reader, Writer};

/// Longest text field in an encoded error; longer messages are cut at a char boundary.
pub const MAX_ERROR_TEXT: usize = 2048;
/// Upper bound of an encoded error (tag, numbers, two text fields).
pub const MAX_ERROR_BYTES: usize = 2 * MAX_ERROR_TEXT + 64;

fn clip(s: &str) -> &str {
    if s.len() <= MAX_ERROR_TEXT {
        return s;
    }
    let mut end = MAX_ERROR_TEXT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Encodes `e` (at most [`MAX_ERROR_BYTES`]).
pub fn encode_error(e: &Error) -> Vec<u8> {
    let mut w = Writer::new();
    match e {
        Error::NotFound(m) => {
            w.u8(1);
            match m {
                Missing::Region(id) => w.u8(1).u64(id.0),
                Missing::Deregistered(id) => w.u8(2).u64(id.0),
                Missing::Peer(p) => w.u8(3).str(clip(p)),
                Missing::Transfer(t) => w.u8(4).u64(*t),
                Missing::Other(s) => w.u8(5).str(clip(s)),
            };
        }
        Error::Unsupported { backend, what } => {
            w.u8(2).str(backend).str(clip(what));
        }
        Error::OutOfBounds { what, offset, len, limit } => {
            w.u8(3).str(clip(what)).u64(*offset).u64(*len).u64(*limit);
        }
        Error::AccessDenied(s) => {
            w.u8(4).str(clip(s));
        }
        Error::PeerClosed(s) => {
            w.u8(5).str(clip(s));
        }
        Error::Timeout { what, after } => {
            let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
            w.u8(6).str(clip(what)).u64(ms);
        }
        Error::Capacity { what, requested, limit } => {
            w.u8(7).str(clip(what)).u64(*requested).u64(*limit);
        }
        Error::InvalidTensor(s) => {
            w.u8(8).str(clip(s));
        }
        Error::Protocol(s) => {
            w.u8(9).str(clip(s));
        }
        Error::InvalidArgument(s) => {
            w.u8(10).str(clip(s));
        }
        Error::Checksum { what, expected, actual } => {
            w.u8(12).str(clip(what)).u32(*expected).u32(*actual);
        }
        Error::Backend { backend, source } => {
            w.u8(11).str(backend).str(clip(&source.to_string()));
        }
        Error::Internal(s) => {
            w.u8(13).str(clip(s));
        }
    }
    w.finish()
}

/// A remote backend's failure, as text.
#[derive(Debug)]
struct RemoteFailure(String);

impl std::fmt::Display for RemoteFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RemoteFailure {}

/// Backend names an error keeps across the wire (the variants hold a `&'static str`).
const KNOWN_BACKENDS: [&str; 9] =
    ["mem", "tcp", "shm", "ucx", "rdma", "cuda", "nccl", "engine", "remote"];

/// The backend name and text of a relayed backend error: a known name is kept as is; any other
/// becomes "remote" with the peer's name moved into the text. Relaying the result again changes
/// nothing.
fn relayed(backend: String, text: String) -> (&'static str, String) {
    match KNOWN_BACKENDS.iter().find(|k| **k == backend) {
        Some(k) => (k, text),
        None => ("remote", format!("{backend}: {text}")),
    }
}

/// Decodes an error sent by a peer: the same variant and numbers; a backend name outside the
/// known ones becomes "remote", with the name kept in the text.
pub fn decode_error(buf: &[u8]) -> Result<Error> {
    if buf.len() > MAX_ERROR_BYTES {
        return Err(Error::protocol(format!(
            "error body is {} bytes, limit {MAX_ERROR_BYTES}",
            buf.len()
        )));
    }
    let mut r = Reader::new(buf, "error body");
    let text = |r: &mut Reader<'_>, f: &str| r.str(MAX_ERROR_TEXT, f);
    let e = match r.u8()? {
        1 => Error::NotFound(match r.u8()? {
            1 => Missing::Region(RegionId(r.u64()?)),
            2 => Missing::Deregistered(RegionId(r.u64()?)),
            3 => Missing::Peer(text(&mut r, "peer")?),
            4 => Missing::Transfer(r.u64()?),
            5 => Missing::Other(text(&mut r, "what")?),
            t => return Err(Error::protocol(format!("error body: unknown missing kind {t}"))),
        }),
        2 => {
            let (backend, what) = relayed(text(&mut r, "backend")?, text(&mut r, "what")?);
            Error::Unsupported { backend, what }
        }
        3 => Error::OutOfBounds {
            what: text(&mut r, "what")?,
            offset: r.u64()?,
            len: r.u64()?,
            limit: r.u64()?,
        },
        4 => Error::AccessDenied(text(&mut r, "reason")?),
        5 => Error::PeerClosed(text(&mut r, "reason")?),
        6 => {
            let what = text(&mut r, "what")?;
            Error::Timeout { what, after: Duration::from_millis(r.u64()?) }
        }
        7 => Error::Capacity { what: text(&mut r, "what")?, requested: r.u64()?, limit: r.u64()? },
        8 => Error::InvalidTensor(text(&mut r, "reason")?),
        9 => Error::Protocol(text(&mut r, "reason")?),
        10 => Error::InvalidArgument(text(&mut r, "reason")?),
        11 => {
            let (backend, msg) = relayed(text(&mut r, "backend")?, text(&mut r, "message")?);
            Error::Backend { backend, source: Arc::new(RemoteFailure(msg)) }
        }
        12 => Error::Checksum { what: text(&mut r, "what")?, expected: r.u32()?, actual: r.u32()? },
        13 => Error::Internal(text(&mut r, "reason")?),
        t => return Err(Error::protocol(format!("error body: unknown error tag {t}"))),
    };
    r.finish()?;
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round(e: Error) -> Error {
        let b = encode_error(&e);
        assert!(b.len() <= MAX_ERROR_BYTES);
        decode_error(&b).unwrap()
    }

    #[test]
    fn variants_survive_the_wire() {
        let e = round(Error::OutOfBounds { what: "r 1".into(), offset: 9, len: 2, limit: 10 });
        assert!(matches!(e, Error::OutOfBounds { offset: 9, len: 2, limit: 10, .. }));
        let e = round(Error::NotFound(Missing::Deregistered(RegionId(7))));
        assert!(matches!(e, Error::NotFound(Missing::Deregistered(RegionId(7)))));
        let e = round(Error::timeout("x", Duration::from_millis(1500)));
        assert!(matches!(e, Error::Timeout { after, .. } if after == Duration::from_millis(1500)));
        let e = round(Error::Capacity { what: "q".into(), requested: 5, limit: 4 });
        assert!(matches!(e, Error::Capacity { requested: 5, limit: 4, .. }));
        let e = round(Error::AccessDenied("wrong key".into()));
        assert_eq!(e.to_string(), "access denied: wrong key");
        let e = round(Error::Unsupported { backend: "tcp", what: "gpu".into() });
        assert_eq!(e.to_string(), "tcp: unsupported: gpu");
        let e = round(Error::Unsupported { backend: "thirdparty", what: "gpu".into() });
        assert_eq!(e.to_string(), "remote: unsupported: thirdparty: gpu");
        // Found by the store_rpc fuzz target: relaying twice used to prefix the name twice.
        assert_eq!(round(e).to_string(), "remote: unsupported: thirdparty: gpu");
        let e = round(Error::Checksum { what: "w".into(), expected: 1, actual: 2 });
        assert!(matches!(e, Error::Checksum { expected: 1, actual: 2, .. }));
        let e = round(Error::Internal("op lost".into()));
        assert!(matches!(e, Error::Internal(s) if s == "op lost"));
        let long = "é".repeat(5000);
        assert!(
            matches!(round(Error::Protocol(long)), Error::Protocol(s) if s.len() <= MAX_ERROR_TEXT)
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_error(&bytes);
        }

        #[test]
        fn relaying_a_decoded_error_changes_nothing(
            tag in 1u8..14,
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut bytes = vec![tag];
            bytes.extend(body);
            if let Ok(e) = decode_error(&bytes) {
                prop_assert_eq!(round(e.clone()).to_string(), e.to_string());
            }
        }
    }
}
