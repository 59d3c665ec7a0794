//! The file spill tier: an evicted object becomes one file, `<dir>/<object id>.twspill`: a
//! 4 KiB header (magic and version, key, TensorMeta, length, crc32c of the bytes, the lease as
//! of the spill: retention, consumers expected, expiry in Unix milliseconds; then crc32c of the
//! header) then the bytes at offset 4096. Reads land straight in the destination memory and are
//! verified; a truncated or corrupt file is reported as [`StoreError::Corrupt`], never served.
//! Since a file says everything about its object, a store that restarts on the same directory
//! rebuilds its index from the headers ([`Spill::scan`]), checking every file's bytes; a file
//! that fails is deleted with a log line.
//! This is the only place the store touches bytes outside `MemSlice`'s safe accessors: file I/O
//! into registered host memory. File I/O goes through io_uring when the kernel allows it and
//! positioned `pread`/`pwrite` otherwise; writes of pool blocks use `O_DIRECT` when the file system
//! supports it (blocks are page-aligned whole pages). Both are detected at start.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tensorwire_core::{MemSlice, TensorMeta};
use tensorwire_proto::wire::codec::{Reader, Writer};

use crate::alloc::ALIGN;
use crate::api::{MAX_KEY, Retention};
use crate::error::{Result, StoreError, StoreKey};
use crate::uring::FileIo;

const MAGIC: &[u8; 8] = b"TWSPILL2";
const HEADER: u64 = 4096;

/// The spill directory.
#[derive(Debug)]
pub(crate) struct Spill {
    dir: PathBuf,
    direct: bool,
    io: FileIo,
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> StoreError {
    move |e| StoreError::Io { what, source: std::sync::Arc::new(e) }
}

/// Creates (or truncates) `path` for writing with O_DIRECT.
fn create_direct(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

impl Spill {
    /// Uses (and creates) `dir`; probes O_DIRECT there.
    pub(crate) fn new(dir: &Path) -> Result<Spill> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let probe = dir.join(".twspill-probe");
        let direct = create_direct(&probe).is_ok();
        let _ = std::fs::remove_file(&probe);
        Ok(Spill { dir: dir.to_path_buf(), direct, io: FileIo::new() })
    }

    /// How files are written and read, e.g. "io_uring, O_DIRECT".
    pub(crate) fn describe(&self) -> String {
        format!(
            "{}{}",
            if self.io.uring() { "io_uring" } else { "pread/pwrite" },
            if self.direct { ", O_DIRECT for blocks" } else { "" }
        )
    }

    /// Whether block writes use O_DIRECT.
    pub(crate) fn direct(&self) -> bool {
        self.direct
    }

    fn path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:016x}.twspill"))
    }

    /// Writes an object's `len` bytes, held at the start of `block` (its whole, page-aligned pool
    /// block), to its file, with its lease as of now.
    pub(crate) fn write(
        &self,
        id: u64,
        key: &[u8],
        meta: &TensorMeta,
        lease: &Lease,
        block: &MemSlice,
        len: u64,
    ) -> Result<()> {
        let data = block.sub(0, len)?;
        let mut w = Writer::new();
        w.raw(MAGIC).bytes(key);
        meta.encode(&mut w);
        w.u64(len).u32(data.crc32c()?);
        w.u8(lease.retention.tag()).u32(lease.consumers).u64(lease.expires_ms);
        let mut head = w.finish();
        let hcrc = crc32c::crc32c(&head);
        head.extend_from_slice(&hcrc.to_le_bytes());
        if head.len() as u64 > HEADER {
            return Err(StoreError::Capacity {
                what: "spill header".into(),
                requested: head.len() as u64,
                limit: HEADER,
            });
        }
        head.resize(HEADER as usize, 0);
        let path = self.path(id);
        let what = format!("write {}", path.display());
        let aligned = block.ptr() as u64 % ALIGN == 0 && block.len() % ALIGN == 0;
        if self.direct && aligned {
            let f = create_direct(&path).map_err(io_err(what.clone()))?;
            // The header goes through an aligned bounce page (O_DIRECT needs aligned memory).
            let page = AlignedPage::new(&head)?;
            self.io.write_all_at(&f, page.bytes(), 0).map_err(io_err(what.clone()))?;
            block
                .with_host_bytes(|whole| self.io.write_all_at(&f, whole, HEADER))?
                .map_err(io_err(what.clone()))?;
            f.set_len(HEADER + len).map_err(io_err(what))?;
        } else {
            let f = File::create(&path).map_err(io_err(what.clone()))?;
            self.io.write_all_at(&f, &head, 0).map_err(io_err(what.clone()))?;
            data.with_host_bytes(|d| self.io.write_all_at(&f, d, HEADER))?.map_err(io_err(what))?;
        }
        Ok(())
    }

    /// Reads object `id` into `dst` (registered host memory of exactly its length), checking
    /// the key, the length and the checksum. The file's bytes land through the slice's pointer,
    /// as a transfer's would.
    pub(crate) fn read_into(&self, id: u64, key: &[u8], dst: &MemSlice) -> Result<TensorMeta> {
        if !dst.kind().is_host() {
            return Err(StoreError::Engine(tensorwire_core::Error::Unsupported {
                backend: "store",
                what: format!("spill reads into {:?} memory", dst.kind()),
            }));
        }
        let len = usize::try_from(dst.len())
            .map_err(|_| StoreError::Internal("a slice larger than memory".into()))?;
        self.read_with(
            id,
            key,
            dst.len(),
            |f| {
                // SAFETY: `dst` is `len` bytes of live host memory, kept registered and mapped by
                // its gate for the call.
                unsafe { self.io.read_exact_at_ptr(f, dst.ptr(), len, HEADER) }
            },
            || Ok(dst.crc32c()?),
        )
    }

    /// Reads object `id` into `out` (exactly its length), checking the key, the length and the
    /// checksum.
    pub(crate) fn read(&self, id: u64, key: &[u8], out: &mut [u8]) -> Result<TensorMeta> {
        let len = out.len() as u64;
        let crc = std::cell::Cell::new(0);
        self.read_with(
            id,
            key,
            len,
            |f| {
                self.io.read_exact_at(f, out, HEADER)?;
                crc.set(crc32c::crc32c(out));
                Ok(())
            },
            || Ok(crc.get()),
        )
    }

    /// Opens object `id`'s file, checks its header against `key` and `len`, fills the
    /// destination with `fill`, and checks `crc_of` the destination against the stored checksum.
    fn read_with(
        &self,
        id: u64,
        key: &[u8],
        len: u64,
        fill: impl FnOnce(&File) -> std::io::Result<()>,
        crc_of: impl FnOnce() -> Result<u32>,
    ) -> Result<TensorMeta> {
        let path = self.path(id);
        let what = format!("spill {}", path.display());
        let f = File::open(&path).map_err(io_err(format!("open {}", path.display())))?;
        let corrupt = |e: String| {
            StoreError::Corrupt(format!("{what} (key {}): {e}", StoreKey(key.to_vec())))
        };
        let mut head = vec![0u8; HEADER as usize];
        self.io
            .read_exact_at(&f, &mut head, 0)
            .map_err(|e| corrupt(format!("header unreadable ({e}): truncated")))?;
        let h = parse_header(&head).map_err(corrupt)?;
        if h.key != key {
            return Err(corrupt(format!("holds key {}", StoreKey(h.key))));
        }
        let (meta, stored_len, crc) = (h.meta, h.len, h.crc);
        if stored_len != len {
            return Err(corrupt(format!("holds {stored_len} bytes, expected {len}")));
        }
        fill(&f).map_err(|e| corrupt(format!("data unreadable ({e}): truncated")))?;
        let actual = crc_of()?;
        if actual != crc {
            return Err(corrupt(format!("checksum {actual:#010x}, expected {crc:#010x}")));
        }
        Ok(meta)
    }

    /// Deletes object `id`'s file (missing files are fine).
    pub(crate) fn remove(&self, id: u64) {
        let _ = std::fs::remove_file(self.path(id));
    }

    /// The file of object `id` (tests corrupt it).
    pub(crate) fn file(&self, id: u64) -> PathBuf {
        self.path(id)
    }

    /// Every object the directory holds, each file's header parsed and its bytes checked
    /// against the header's checksum; a file that fails either is deleted with a log line, as is
    /// one whose lease expired. Other files are left alone.
    pub(crate) fn scan(&self) -> Result<Vec<Found>> {
        let what = format!("list {}", self.dir.display());
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io_err(what.clone()))? {
            let path = entry.map_err(io_err(what.clone()))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let Some(id) = name
                .strip_suffix(".twspill")
                .filter(|h| h.len() == 16)
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            match self.check(&path) {
                Ok(h) if h.expired() => {
                    tracing::info!(file = %path.display(), "store: spilled object expired; deleted");
                    self.remove(id);
                }
                Ok(h) => found.push(Found { id, header: h }),
                Err(why) => {
                    tracing::warn!(file = %path.display(), "store: dropping spill file: {why}");
                    self.remove(id);
                }
            }
        }
        found.sort_by_key(|f| f.id);
        Ok(found)
    }

    /// Parses a file's header and checks its bytes (read in pieces, never all at once).
    fn check(&self, path: &Path) -> std::result::Result<Header, String> {
        let f = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
        let mut head = vec![0u8; HEADER as usize];
        self.io.read_exact_at(&f, &mut head, 0).map_err(|e| format!("header unreadable: {e}"))?;
        let h = parse_header(&head)?;
        let size = f.metadata().map_err(|e| e.to_string())?.len();
        if size != HEADER + h.len {
            return Err(format!(
                "{} data bytes, the header says {}",
                size - HEADER.min(size),
                h.len
            ));
        }
        let mut crc = 0u32;
        let mut buf = vec![0u8; (1 << 20).min(h.len) as usize];
        let mut at = 0u64;
        while at < h.len {
            let n = buf.len().min((h.len - at) as usize);
            self.io
                .read_exact_at(&f, &mut buf[..n], HEADER + at)
                .map_err(|e| format!("data unreadable: {e}"))?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            at += n as u64;
        }
        if crc != h.crc {
            return Err(format!("checksum {crc:#010x}, expected {:#010x}", h.crc));
        }
        Ok(h)
    }
}

/// An object's lease as a spill file keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub(crate) retention: Retention,
    pub(crate) consumers: u32,
    /// Expiry in milliseconds since the Unix epoch (0: none).
    pub(crate) expires_ms: u64,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Lease {
    /// `expires` (a monotonic deadline) as wall-clock milliseconds.
    pub(crate) fn new(retention: Retention, consumers: u32, expires: Option<Instant>) -> Lease {
        let expires_ms = expires.map_or(0, |t| {
            let left = t.saturating_duration_since(Instant::now());
            unix_ms(SystemTime::now() + left).max(1)
        });
        Lease { retention, consumers, expires_ms }
    }

    /// The expiry as a monotonic deadline (`None`: none).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        (self.expires_ms != 0).then(|| {
            let left = self.expires_ms.saturating_sub(unix_ms(SystemTime::now()));
            Instant::now() + Duration::from_millis(left)
        })
    }
}

/// A spill file's header.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub(crate) key: Vec<u8>,
    pub(crate) meta: TensorMeta,
    pub(crate) len: u64,
    crc: u32,
    pub(crate) lease: Lease,
}

impl Header {
    fn expired(&self) -> bool {
        self.lease.expires_ms != 0 && self.lease.expires_ms <= unix_ms(SystemTime::now())
    }
}

/// An object found by [`Spill::scan`].
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub(crate) id: u64,
    pub(crate) header: Header,
}

/// Parses and checks a spill header; the error says what is wrong with it. Never panics.
fn parse_header(head: &[u8]) -> std::result::Result<Header, String> {
    let mut r = Reader::new(head, "spill header");
    let magic = r.raw(MAGIC.len()).map_err(|e| e.to_string())?;
    if magic != MAGIC {
        return Err("not a tensorwire spill file of this version (bad magic)".into());
    }
    let fields = (|| {
        let key = r.bytes(MAX_KEY, "key")?.to_vec();
        let meta = TensorMeta::decode(&mut r)?;
        let (len, crc) = (r.u64()?, r.u32()?);
        let retention = Retention::from_tag(r.u8()?)?;
        let lease = Lease { retention, consumers: r.u32()?, expires_ms: r.u64()? };
        Ok::<_, tensorwire_core::Error>(Header { key, meta, len, crc, lease })
    })();
    let h = fields.map_err(|e| e.to_string())?;
    let used = head.len() - r.rest().len();
    let hcrc = head
        .get(used..used + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or("header truncated")?;
    let actual = crc32c::crc32c(&head[..used]);
    if hcrc != actual {
        return Err(format!("header checksum {actual:#010x}, expected {hcrc:#010x}"));
    }
    Ok(h)
}

/// One page-aligned page (for O_DIRECT header writes).
struct AlignedPage {
    ptr: *mut u8,
}

impl AlignedPage {
    fn new(bytes: &[u8]) -> Result<AlignedPage> {
        let layout = std::alloc::Layout::from_size_align(HEADER as usize, ALIGN as usize)
            .map_err(|_| StoreError::Internal("spill header page layout".into()))?;
        // SAFETY: non-zero size layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(StoreError::Capacity {
                what: "spill header page".into(),
                requested: HEADER,
                limit: 0,
            });
        }
        // SAFETY: `ptr` holds HEADER bytes; `bytes` is at most HEADER long (checked by the caller).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len().min(HEADER as usize))
        };
        Ok(AlignedPage { ptr })
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds HEADER initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, HEADER as usize) }
    }
}

impl Drop for AlignedPage {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(HEADER as usize, ALIGN as usize) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr, layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_parse_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_header(&bytes);
        }
    }
}
