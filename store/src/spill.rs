//! The file spill tier: an evicted object becomes one file, `<dir>/<object id>.twspill`: a
//! 4 KiB header (magic, version, key, TensorMeta, length, crc32c of the bytes, crc32c of the
//! header) then the bytes at offset 4096. Reads land straight in the destination memory and are
//! verified; a truncated or corrupt file is reported as [`StoreError::Corrupt`], never served.
//! This is the only place the store touches bytes outside `MemSlice`'s safe accessors: file I/O
//! into registered host memory. File I/O goes through io_uring when the kernel allows it and
//! positioned `pread`/`pwrite` otherwise; writes of pool blocks use `O_DIRECT` when the file system
//! supports it (blocks are page-aligned whole pages). Both are detected at start.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::{MemSlice, TensorMeta};

use crate::alloc::ALIGN;
use crate::api::MAX_KEY;
use crate::error::{Result, StoreError, StoreKey};
use crate::uring::FileIo;

const MAGIC: &[u8; 8] = b"TWSPILL1";
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
    /// block), to its file.
    pub(crate) fn write(
        &self,
        id: u64,
        key: &[u8],
        meta: &TensorMeta,
        block: &MemSlice,
        len: u64,
    ) -> Result<()> {
        let data = block.sub(0, len)?;
        let mut w = Writer::new();
        w.raw(MAGIC).bytes(key);
        meta.encode(&mut w);
        w.u64(len).u32(data.crc32c()?);
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
        let (meta, stored_len, crc) = parse_header(&head, key).map_err(corrupt)?;
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
}

/// Parses and checks a spill header; the error says what is wrong with it. Never panics.
fn parse_header(head: &[u8], key: &[u8]) -> std::result::Result<(TensorMeta, u64, u32), String> {
    let mut r = Reader::new(head, "spill header");
    let magic = r.raw(MAGIC.len()).map_err(|e| e.to_string())?;
    if magic != MAGIC {
        return Err("not a tensorwire spill file (bad magic)".into());
    }
    let fields = (|| {
        let stored_key = r.bytes(MAX_KEY, "key")?;
        let meta = TensorMeta::decode(&mut r)?;
        Ok::<_, tensorwire_core::Error>((stored_key, meta, r.u64()?, r.u32()?))
    })();
    let (stored_key, meta, len, crc) = fields.map_err(|e| e.to_string())?;
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
    if stored_key != key {
        return Err(format!("holds key {}", StoreKey(stored_key.to_vec())));
    }
    Ok((meta, len, crc))
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
            let _ = parse_header(&bytes, b"k");
        }
    }
}
