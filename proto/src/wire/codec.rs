//! Bounded little-endian encoding helpers. `Reader` never panics: every read checks the remaining
//! length and every variable-length field is checked against a caller-given bound first.

use bytes::Bytes;

use crate::error::{Error, Result};

/// Appends fields to a byte vector.
#[derive(Debug)]
pub struct Writer {
    buf: Vec<u8>,
}

/// Room a new writer starts with: every fixed header and most messages fit, so they cost one
/// allocation instead of one per doubling (a tcp data header took four).
const INITIAL: usize = 64;

impl Default for Writer {
    fn default() -> Self {
        Writer { buf: Vec::with_capacity(INITIAL) }
    }
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }
    /// Appends one byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    /// Appends a flag as one byte, 0 or 1.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }
    /// Appends a u32 length then the bytes.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        // Callers bound their fields far below 4 GiB; saturate rather than wrap if one does not.
        self.u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
        self.buf.extend_from_slice(v);
        self
    }
    /// Appends a length-prefixed UTF-8 string.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    /// Appends an optional value: a presence byte (0 or 1), then the value written by `put`.
    pub fn opt<T>(&mut self, v: Option<T>, put: impl FnOnce(&mut Self, T)) -> &mut Self {
        match v {
            Some(v) => {
                self.u8(1);
                put(self, v);
            }
            None => {
                self.u8(0);
            }
        }
        self
    }
    /// Appends raw bytes without a length.
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    /// The encoded bytes.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
    /// The encoded bytes as a fixed-size header: callers write exactly `N` bytes (their tests
    /// check the length); a shorter encoding is zero-padded, a longer one cut.
    pub fn finish_fixed<const N: usize>(self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = self.buf.len().min(N);
        out[..n].copy_from_slice(&self.buf[..n]);
        out
    }
}

/// `Writer::$t` appends a little-endian `$t`; `Reader::$t` reads one.
macro_rules! little_endian {
    ($($t:ident),*) => {
        impl Writer {
            $(
                #[doc = concat!("Appends a little-endian `", stringify!($t), "`.")]
                pub fn $t(&mut self, v: $t) -> &mut Self {
                    self.buf.extend_from_slice(&v.to_le_bytes());
                    self
                }
            )*
        }
        impl Reader<'_> {
            $(
                #[doc = concat!("Reads a little-endian `", stringify!($t), "`.")]
                pub fn $t(&mut self) -> Result<$t> {
                    Ok($t::from_le_bytes(self.array()?))
                }
            )*
        }
    };
}

little_endian!(u16, u32, u64, u128);

/// Reads fields from a byte slice; every method returns [`Error::Protocol`] on short or bad input.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`; `what` names the message in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(Error::protocol(format!(
                "{}: truncated: need {n} more bytes, have {}",
                self.what,
                self.buf.len()
            )));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    /// Reads `n` raw bytes (what [`Writer::raw`] wrote).
    pub fn raw(&mut self, n: usize) -> Result<&'a [u8]> {
        self.take(n)
    }
    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    /// Reads what [`Writer::bool`] wrote; a byte other than 0 or 1 is an error naming `field`.
    pub fn bool(&mut self, field: &str) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            t => Err(Error::protocol(format!("{}: {field} flag {t}", self.what))),
        }
    }
    /// Reads a length-prefixed byte string of at most `max` bytes.
    pub fn bytes(&mut self, max: usize, field: &str) -> Result<&'a [u8]> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(Error::protocol(format!(
                "{}: {field} is {len} bytes, limit {max}",
                self.what
            )));
        }
        self.take(len)
    }
    /// Reads a length-prefixed byte string as owned [`Bytes`].
    pub fn owned_bytes(&mut self, max: usize, field: &str) -> Result<Bytes> {
        Ok(Bytes::copy_from_slice(self.bytes(max, field)?))
    }
    /// Reads a length-prefixed UTF-8 string of at most `max` bytes.
    pub fn str(&mut self, max: usize, field: &str) -> Result<String> {
        let raw = self.bytes(max, field)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| Error::protocol(format!("{}: {field} is not UTF-8", self.what)))
    }
    /// Reads what [`Writer::opt`] wrote, the value with `get`; a presence byte other than 0 or 1
    /// is an error naming `field`.
    pub fn opt<T>(
        &mut self,
        field: &str,
        get: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<Option<T>> {
        match self.u8()? {
            0 => Ok(None),
            1 => get(self).map(Some),
            t => Err(Error::protocol(format!("{}: {field}: presence byte {t}", self.what))),
        }
    }
    /// Reads an element count of at most `max`.
    pub fn count(&mut self, max: usize, field: &str) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(Error::protocol(format!("{}: {n} {field}, limit {max}", self.what)));
        }
        Ok(n)
    }
    /// The unread rest.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(Error::protocol(format!("{}: {} trailing bytes", self.what, self.buf.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_0_or_1_and_anything_else_names_its_field() {
        let mut w = Writer::new();
        w.bool(true).bool(false).u8(2);
        let b = w.finish();
        let mut r = Reader::new(&b, "test message");
        assert!(r.bool("a").unwrap());
        assert!(!r.bool("b").unwrap());
        let e = r.bool("write").unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        assert!(e.to_string().contains("test message: write flag 2"), "{e}");
    }
}
