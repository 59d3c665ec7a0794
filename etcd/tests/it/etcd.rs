//! Against a real etcd (started on loopback ports; skipped, with the reason, where there is no
//! `etcd` binary): discovery registers, lists, watches and forgets entries; a standby candidate
//! is elected once the leader is gone; the journal replays to the same book, compacts, and
//! refuses a writer that no longer leads. Needs the `etcd` feature.
#![cfg(feature = "etcd")]

use std::time::Duration;

use tensorwire_etcd::testing::EtcdServer;
use tensorwire_etcd::{EtcdDiscovery, EtcdJournal, Leadership, leader_addr};
use tensorwire_orchestrator::journal::Fact;
use tensorwire_orchestrator::service::JournalStore;
use tensorwire_orchestrator::{Outcome, Priority, Stage};
use tensorwire_proto::discovery::{Change, Discovery, Entry};

fn etcd() -> Option<EtcdServer> {
    match EtcdServer::start() {
        Ok(s) => Some(s),
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

const T: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_registers_lists_watches_and_forgets() {
    let Some(etcd) = etcd() else { return };
    let c = tensorwire_etcd::connect(std::slice::from_ref(&etcd.url), T).await.unwrap();
    let d = EtcdDiscovery::new(c, "disc", Duration::from_secs(2));
    let mut w = d.watch("store").await.unwrap();
    let e = Entry {
        kind: "store".into(),
        id: "n1".into(),
        addr: ([127, 0, 0, 1], 7100).into(),
        meta: b"x".to_vec(),
    };
    let reg = d.register(e.clone()).await.unwrap();
    let got = tokio::time::timeout(T, w.recv()).await.unwrap();
    assert_eq!(got, Some(Change::Joined(e.clone())));
    assert_eq!(d.list("store").await.unwrap(), vec![e]);
    assert!(d.list("engine").await.unwrap().is_empty());
    drop(reg); // revoked: gone at once, not after the TTL
    let got = tokio::time::timeout(T, w.recv()).await.unwrap();
    assert_eq!(got, Some(Change::Left { kind: "store".into(), id: "n1".into() }));
    assert!(d.list("store").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_elected_when_the_leader_goes_and_the_old_one_cannot_write() {
    let Some(etcd) = etcd() else { return };
    let c = tensorwire_etcd::connect(std::slice::from_ref(&etcd.url), T).await.unwrap();
    let (a, b) = ("127.0.0.1:7201".parse().unwrap(), "127.0.0.1:7202".parse().unwrap());
    let ttl = Duration::from_secs(2);
    let first = Leadership::campaign(&c, "el", a, ttl).await.unwrap();
    assert_eq!(leader_addr(&c, "el").await, Some(a));
    let mut j = EtcdJournal::open(&c, "el", first.guard(), 1000).await.unwrap();
    j.append(&Fact::Submitted {
        request: 1,
        priority: Priority::Batch,
        start: Stage::Encode,
        inputs: vec![],
    });
    j.commit().await.unwrap();
    let c2 = c.clone();
    let standby = tokio::spawn(async move { Leadership::campaign(&c2, "el", b, ttl).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!standby.is_finished(), "a standby waits while the leader leads");
    drop(first);
    let second = tokio::time::timeout(T, standby).await.unwrap().unwrap().unwrap();
    assert_eq!(leader_addr(&c, "el").await, Some(b));
    j.append(&Fact::Released { request: 1 });
    assert!(j.commit().await.is_err(), "the old leader's writes are refused");
    let mut j2 = EtcdJournal::open(&c, "el", second.guard(), 3).await.unwrap();
    assert!(j2.book().entries.contains_key(&1), "the new leader reads what the old one wrote");
    for r in 2..10 {
        j2.append(&Fact::Submitted {
            request: r,
            priority: Priority::Batch,
            start: Stage::Encode,
            inputs: vec![],
        });
        j2.append(&Fact::Ended(Outcome::Completed { request: r }));
        j2.commit().await.unwrap(); // compacts every 3 turns
    }
    let book = j2.book().clone();
    let again = EtcdJournal::open(&c, "el", second.guard(), 3).await.unwrap();
    assert_eq!(again.book(), &book, "compacted and replayed to the same book");
    let keys = c.clone().get("/tensorwire/el/journal/", Some(etcd_client_prefix())).await.unwrap();
    assert!(keys.kvs().len() <= 3, "compaction keeps the journal short: {}", keys.kvs().len());
}

fn etcd_client_prefix() -> etcd_client::GetOptions {
    etcd_client::GetOptions::new().with_prefix()
}
