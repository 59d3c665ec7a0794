//! The journal on disk: one append-only file of [`Fact`] records after an 8-byte magic. Facts
//! are appended to a buffer and made durable together ([`JournalFile::commit`]: one write and
//! one `fdatasync`), which the service does before it sends anything that depends on them. On
//! open, the file is replayed; a torn or corrupt tail (a crash mid-write) is cut off with a log
//! line. When the file has grown past twice its last compacted size (and at least
//! `compact_min`), it is rewritten as the snapshot of its fold: written to a temporary file,
//! synced, renamed over the journal, and the directory synced.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::journal::{Book, Fact, replay};

/// Where a service's journal lives: a local file ([`JournalFile`]) or a shared store (the
/// `tensorwire-etcd` crate keeps a standby orchestrator's journal in etcd). Opened (and replayed)
/// before the service starts; the service appends each turn's facts and commits them before it
/// acts on them.
#[async_trait::async_trait]
pub trait JournalStore: Send + std::fmt::Debug {
    /// What the journal said when it was opened, plus everything appended since.
    fn book(&self) -> &Book;
    /// Adds a fact; durable at the next commit.
    fn append(&mut self, f: &Fact);
    /// Makes every appended fact durable. An error stops the service.
    async fn commit(&mut self) -> std::io::Result<()>;
}

/// The file's first bytes.
const MAGIC: &[u8; 8] = b"TWJRNL01";

/// An open journal file.
pub struct JournalFile {
    path: PathBuf,
    file: File,
    book: Book,
    pending: Vec<u8>,
    len: u64,
    compacted: u64,
    compact_min: u64,
}

impl std::fmt::Debug for JournalFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalFile")
            .field("path", &self.path)
            .field("bytes", &self.len)
            .field("requests", &self.book.entries.len())
            .finish()
    }
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}

impl JournalFile {
    /// Opens (or creates) the journal at `path` and replays it; past `compact_min` bytes (and
    /// twice its last compacted size) it is compacted.
    pub fn open(path: &Path, compact_min: u64) -> std::io::Result<JournalFile> {
        let mut file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let mut book = Book::default();
        let len = if bytes.is_empty() {
            file.write_all(MAGIC)?;
            file.sync_all()?;
            sync_dir(path)?;
            MAGIC.len()
        } else {
            if bytes.get(..MAGIC.len()) != Some(&MAGIC[..]) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: not an orchestrator journal (bad magic)", path.display()),
                ));
            }
            let r = replay(&bytes[MAGIC.len()..]);
            r.facts.iter().for_each(|f| book.apply(f));
            let valid = MAGIC.len() + r.valid;
            if let Some(why) = r.stopped {
                tracing::warn!(
                    journal = %path.display(),
                    kept = r.facts.len(),
                    dropped_bytes = bytes.len() - valid,
                    "orchestrator journal: {why}; the records after it are dropped"
                );
                file.set_len(valid as u64)?;
                file.sync_all()?;
            }
            valid
        };
        file.seek(SeekFrom::Start(len as u64))?;
        let len = len as u64;
        Ok(JournalFile {
            path: path.to_path_buf(),
            file,
            book,
            pending: Vec::new(),
            len,
            compacted: len,
            compact_min,
        })
    }

    /// Makes every appended fact durable; compacts when the file has grown enough.
    fn commit_now(&mut self) -> std::io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.file.write_all(&self.pending)?;
        self.file.sync_data()?;
        self.len += self.pending.len() as u64;
        self.pending.clear();
        if self.len >= self.compact_min.max(2 * self.compacted) {
            self.compact()?;
        }
        Ok(())
    }

    /// Rewrites the journal as the snapshot of its fold.
    fn compact(&mut self) -> std::io::Result<()> {
        let tmp = self.path.with_extension("compacting");
        let mut f = File::create(&tmp)?;
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&self.book.snapshot_bytes());
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        sync_dir(&self.path)?;
        let before = self.len;
        self.file = OpenOptions::new().append(true).open(&self.path)?;
        self.len = bytes.len() as u64;
        self.compacted = self.len;
        tracing::debug!(before, after = self.len, "orchestrator journal compacted");
        Ok(())
    }

    /// The file's size.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

#[async_trait::async_trait]
impl JournalStore for JournalFile {
    fn book(&self) -> &Book {
        &self.book
    }

    fn append(&mut self, f: &Fact) {
        self.pending.extend_from_slice(&f.encode());
        self.book.apply(f);
    }

    /// One write and one `fdatasync`, on the caller's thread (the service's loop waits for it
    /// anyway: nothing goes out before it).
    async fn commit(&mut self) -> std::io::Result<()> {
        self.commit_now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::Outcome;
    use crate::{Priority, Stage};

    #[test]
    fn reopens_to_the_same_book_cuts_a_torn_tail_and_compacts() {
        let dir = std::env::temp_dir().join(format!("tw-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("orchestrator.journal");
        let _ = std::fs::remove_file(&path);
        let mut j = JournalFile::open(&path, 1 << 10).unwrap();
        for r in 0..200u64 {
            j.append(&Fact::Submitted {
                request: r,
                priority: Priority::Batch,
                start: Stage::Encode,
                inputs: vec![],
            });
            if r % 2 == 0 {
                j.append(&Fact::Ended(Outcome::Completed { request: r }));
            }
            j.commit_now().unwrap();
        }
        let book = j.book().clone();
        assert!(j.len() < 200 * 40, "compacted as it grew ({} bytes)", j.len());
        drop(j);
        let j = JournalFile::open(&path, 1 << 10).unwrap();
        assert_eq!(j.book(), &book);
        let whole = j.len();
        drop(j);
        // A crash mid-append leaves a torn record: it is cut off, the rest kept.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        let rec = Fact::Submitted {
            request: 999,
            priority: Priority::Batch,
            start: Stage::Encode,
            inputs: vec![],
        }
        .encode();
        f.write_all(&rec[..rec.len() - 3]).unwrap();
        drop(f);
        let j = JournalFile::open(&path, 1 << 10).unwrap();
        assert_eq!((j.book(), j.len()), (&book, whole));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), whole);
        drop(j);
        std::fs::write(&path, b"not a journal").unwrap();
        assert!(JournalFile::open(&path, 1 << 10).is_err(), "a foreign file is refused");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
