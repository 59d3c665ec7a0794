//! The orchestrator's journal in etcd, for a standby orchestrator: each committed turn is one
//! key, `/tensorwire/<cluster>/journal/<sequence, 20 digits>`, holding that turn's records (the
//! same checksummed records as the journal file), written in a transaction that succeeds only
//! while the writer still leads (its election key exists with the same creation revision). A
//! new leader reads every key in order and folds the records into the book it resumes from.
//! Every `compact_every` turns the leader replaces all keys with one holding the snapshot, in
//! one transaction.

use std::io;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, GetOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use tensorwire_orchestrator::journal::{Book, Fact, replay};
use tensorwire_orchestrator::service::JournalStore;

use crate::{cluster_prefix, err};

/// etcd's default request limit is 1.5 MiB: a snapshot larger than this is not written (the
/// journal keeps growing instead, with a warning).
const MAX_VALUE: usize = 1 << 20;

/// A leader's journal in etcd.
pub struct EtcdJournal {
    client: Client,
    prefix: String,
    guard: (Vec<u8>, i64),
    book: Book,
    pending: Vec<u8>,
    next: u64,
    since_compaction: u64,
    compact_every: u64,
}

impl std::fmt::Debug for EtcdJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdJournal")
            .field("prefix", &self.prefix)
            .field("next", &self.next)
            .field("requests", &self.book.entries.len())
            .finish()
    }
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl EtcdJournal {
    /// Reads `cluster`'s journal; later commits are conditioned on `guard` (see
    /// [`crate::Leadership::guard`]).
    pub async fn open(
        client: &Client,
        cluster: &str,
        guard: (Vec<u8>, i64),
        compact_every: u64,
    ) -> tensorwire_core::Result<EtcdJournal> {
        let prefix = format!("{}journal/", cluster_prefix(cluster));
        let opts = GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
        let r = client.clone().get(prefix.clone(), Some(opts)).await.map_err(|e| err("get", e))?;
        let mut book = Book::default();
        let mut next = 0;
        for kv in r.kvs() {
            let rp = replay(kv.value());
            if let Some(why) = &rp.stopped {
                tracing::warn!(key = ?String::from_utf8_lossy(kv.key()), "etcd journal: {why}");
            }
            rp.facts.iter().for_each(|f| book.apply(f));
            let seq = std::str::from_utf8(kv.key())
                .ok()
                .and_then(|k| k.strip_prefix(&prefix))
                .and_then(|s| s.parse::<u64>().ok());
            next = next.max(seq.map_or(0, |s| s + 1));
        }
        tracing::info!(turns = r.kvs().len(), requests = book.entries.len(), "etcd journal read");
        Ok(EtcdJournal {
            client: client.clone(),
            prefix,
            guard,
            book,
            pending: Vec::new(),
            next,
            since_compaction: r.kvs().len() as u64,
            compact_every: compact_every.max(2),
        })
    }

    fn key(&self, seq: u64) -> String {
        format!("{}{seq:020}", self.prefix)
    }

    /// Runs `ops` if this process still leads.
    async fn guarded(&mut self, ops: Vec<TxnOp>) -> io::Result<()> {
        let (key, rev) = self.guard.clone();
        let txn =
            Txn::new().when([Compare::create_revision(key, CompareOp::Equal, rev)]).and_then(ops);
        let r = self.client.txn(txn).await.map_err(io_err)?;
        if r.succeeded() {
            Ok(())
        } else {
            Err(io_err("etcd journal: this orchestrator no longer leads; not writing"))
        }
    }

    async fn compact(&mut self) -> io::Result<()> {
        let snap = self.book.snapshot_bytes();
        if snap.len() > MAX_VALUE {
            tracing::warn!(bytes = snap.len(), "etcd journal: snapshot too large to compact");
            return Ok(());
        }
        let seq = self.next;
        let ops = vec![
            TxnOp::delete(self.key(0), Some(DeleteOptions::new().with_range(self.key(seq)))),
            TxnOp::put(self.key(seq), snap, None),
        ];
        self.guarded(ops).await?;
        self.next += 1;
        self.since_compaction = 1;
        Ok(())
    }
}

#[async_trait]
impl JournalStore for EtcdJournal {
    fn book(&self) -> &Book {
        &self.book
    }

    fn append(&mut self, f: &Fact) {
        self.pending.extend_from_slice(&f.encode());
        self.book.apply(f);
    }

    async fn commit(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let value = std::mem::take(&mut self.pending);
        let key = self.key(self.next);
        self.guarded(vec![TxnOp::put(key, value, None)]).await?;
        self.next += 1;
        self.since_compaction += 1;
        if self.since_compaction >= self.compact_every {
            self.compact().await?;
        }
        Ok(())
    }
}
