//! The file spill tier: an evicted object becomes one file, `<dir>/<object id>.twspill`: a
//! 4 KiB header (magic, version, key, TensorMeta, length, crc32c of the bytes, crc32c of the
//! header) then the bytes at offset 4096. Reads land straight in the destination memory and are
//! verified; a truncated or corrupt file is reported as [`Error::Checksum`] or
//! [`Error::Protocol`], never served. File I/O goes through io_uring when the kernel allows it and
//! positioned `pread`/`pwrite` otherwise; writes of pool blocks use `O_DIRECT` when the file system
//! supports it (blocks are page-aligned whole pages). Both are detected at start.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use tensorwire_core::wire::codec::{Reader, Writer};
use tensorwire_core::{Error, Result, TensorMeta};

use crate::alloc::ALIGN;
use crate::api::{MAX_KEY, show_key};
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

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Backend {
        backend: "store spill",
        source: std::sync::Arc::new(std::io::Error::new(e.kind(), format!("{what}: {e}"))),
    }
}

impl Spill {
    /// Uses (and creates) `dir`; probes O_DIRECT there.
    pub(crate) fn new(dir: &Path) -> Result<Spill> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
        let probe = dir.join(".twspill-probe");
        let direct = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe)
            .is_ok();
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

    /// Writes an object's bytes (`len` at `src`, inside a page-aligned block of `block` bytes).
    ///
    /// # Safety
    /// `[src, src+block)` must be readable for the duration of the call.
    pub(crate) unsafe fn write(
        &self,
        id: u64,
        key: &[u8],
        meta: &TensorMeta,
        src: usize,
        len: u64,
        block: u64,
    ) -> Result<()> {
        // SAFETY: the caller guarantees `len <= block` readable bytes at `src`.
        let data = unsafe { std::slice::from_raw_parts(src as *const u8, len as usize) };
        let mut w = Writer::new();
        w.raw(MAGIC).bytes(key);
        meta.encode(&mut w);
        w.u64(len).u32(crc32c::crc32c(data));
        let mut head = w.finish();
        let hcrc = crc32c::crc32c(&head);
        head.extend_from_slice(&hcrc.to_le_bytes());
        if head.len() as u64 > HEADER {
            return Err(Error::Capacity {
                what: "spill header".into(),
                requested: head.len() as u64,
                limit: HEADER,
            });
        }
        head.resize(HEADER as usize, 0);
        let path = self.path(id);
        let what = format!("spill {}", path.display());
        let aligned = src % ALIGN as usize == 0 && block % ALIGN == 0 && block >= len;
        if self.direct && aligned {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .map_err(io_err(what.clone()))?;
            // The header goes through an aligned bounce page (O_DIRECT needs aligned memory).
            let page = AlignedPage::new(&head)?;
            self.io.write_all_at(&f, page.bytes(), 0).map_err(io_err(what.clone()))?;
            // SAFETY: the block is `block` readable, page-aligned bytes (caller's contract).
            let whole = unsafe { std::slice::from_raw_parts(src as *const u8, block as usize) };
            self.io.write_all_at(&f, whole, HEADER).map_err(io_err(what.clone()))?;
            f.set_len(HEADER + len).map_err(io_err(what))?;
        } else {
            let f = File::create(&path).map_err(io_err(what.clone()))?;
            self.io.write_all_at(&f, &head, 0).map_err(io_err(what.clone()))?;
            self.io.write_all_at(&f, data, HEADER).map_err(io_err(what))?;
        }
        Ok(())
    }

    /// Reads object `id` into `[dst, dst+len)`, checking the key, the length and the checksum.
    ///
    /// # Safety
    /// `[dst, dst+len)` must be writable for the duration of the call.
    pub(crate) unsafe fn read_into(
        &self,
        id: u64,
        key: &[u8],
        dst: usize,
        len: u64,
    ) -> Result<TensorMeta> {
        let path = self.path(id);
        let what = format!("spill {}", path.display());
        let f = File::open(&path).map_err(io_err(what.clone()))?;
        let mut head = vec![0u8; HEADER as usize];
        self.io
            .read_exact_at(&f, &mut head, 0)
            .map_err(|e| Error::protocol(format!("{what}: header unreadable ({e}): truncated")))?;
        let (meta, stored_len, crc) =
            parse_header(&head, key).map_err(|e| Error::protocol(format!("{what}: {e}")))?;
        if stored_len != len {
            return Err(Error::protocol(format!(
                "{what}: holds {stored_len} bytes, expected {len}"
            )));
        }
        // SAFETY: the caller guarantees `len` writable bytes at `dst`.
        let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len as usize) };
        self.io
            .read_exact_at(&f, out, HEADER)
            .map_err(|e| Error::protocol(format!("{what}: data unreadable ({e}): truncated")))?;
        let actual = crc32c::crc32c(out);
        if actual != crc {
            return Err(Error::Checksum {
                what: format!("{what} (key {})", show_key(key)),
                expected: crc,
                actual,
            });
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

fn parse_header(head: &[u8], key: &[u8]) -> Result<(TensorMeta, u64, u32)> {
    let mut r = Reader::new(head, "spill header");
    let magic = r.u64()?.to_le_bytes();
    if &magic != MAGIC {
        return Err(Error::protocol("not a tensorwire spill file (bad magic)"));
    }
    let stored_key = r.bytes(MAX_KEY, "key")?;
    let meta = TensorMeta::decode(&mut r)?;
    let len = r.u64()?;
    let crc = r.u32()?;
    let used = head.len() - r.rest().len();
    let hcrc = u32::from_le_bytes(
        head.get(used..used + 4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| Error::protocol("spill header truncated"))?,
    );
    let actual = crc32c::crc32c(&head[..used]);
    if hcrc != actual {
        return Err(Error::Checksum { what: "spill header".into(), expected: hcrc, actual });
    }
    if stored_key != key {
        return Err(Error::protocol(format!(
            "spill file holds key {}, expected {}",
            show_key(stored_key),
            show_key(key)
        )));
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
            .map_err(|_| Error::protocol("layout"))?;
        // SAFETY: non-zero size layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Capacity {
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
