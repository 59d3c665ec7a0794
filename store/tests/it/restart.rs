//! A persistent store survives its restart: objects in the spill tier are found again by a
//! store opened on the same directory (index rebuilt from the file headers, each file's bytes
//! checked, a corrupt or truncated one dropped with a log line), with their metadata and lease;
//! a clean shutdown writes what is still in the pool (pinned objects too) first. After a crash
//! (no shutdown) what had been spilled survives.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{DType, Engine, TensorMeta, backend::MemBackend};
use tensorwire_store::{EmbeddedStore, Retention, Store, StoreConfig};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tw-store-restart-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

async fn open(e: &Engine, spill: &Path) -> Arc<EmbeddedStore> {
    let cfg = StoreConfig {
        capacity: 4 << 20,
        high_watermark: 0.75,
        low_watermark: 0.5,
        spill_dir: Some(spill.to_path_buf()),
        persist: true,
        ..StoreConfig::default()
    };
    EmbeddedStore::new(e, cfg).await.unwrap()
}

fn data(i: usize) -> Vec<u8> {
    (0..(700 << 10) + i * 13).map(|j| (j * 31 + i * 7) as u8).collect()
}

fn meta(n: usize) -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[n as u64])
}

fn files(d: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "twspill"))
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn a_clean_restart_keeps_every_object_and_drops_corrupt_files() {
    let d = dir("clean");
    let e = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
    let s = open(&e, &d).await;
    for i in 0..8 {
        let r = if i == 7 { Retention::Pinned } else { Retention::Normal };
        s.put(format!("o{i}").as_bytes(), &meta(data(i).len()), &data(i), r).await.unwrap();
    }
    s.set_lease(b"o6", 2, Some(Duration::from_secs(3600))).await.unwrap();
    s.consumed(b"o6").await.unwrap();
    assert!(s.stats().await.unwrap().spilled_objects >= 2, "the pool is small: some spill");
    let wrote = s.shutdown().unwrap();
    assert!(wrote >= 1, "what was in the pool (the pinned object at least) is written");
    drop(s);
    // Two files go bad while the store is down: one flipped byte, one cut short.
    let fs = files(&d);
    assert_eq!(fs.len(), 8, "{fs:?}");
    let mut b = std::fs::read(&fs[0]).unwrap();
    let n = b.len();
    b[n - 100] ^= 1;
    std::fs::write(&fs[0], &b).unwrap();
    std::fs::OpenOptions::new().write(true).open(&fs[1]).unwrap().set_len(5000).unwrap();

    let s = open(&e, &d).await;
    let st = s.stats().await.unwrap();
    assert_eq!((st.objects, st.spilled_objects), (0, 6), "two corrupt files dropped: {st:?}");
    assert_eq!(files(&d).len(), 6, "and deleted");
    let mut kept = 0;
    for i in 0..8 {
        let key = format!("o{i}");
        match s.get(key.as_bytes()).await {
            Ok((m, bytes)) => {
                assert_eq!((m, bytes), (meta(data(i).len()), data(i)), "{key}");
                kept += 1;
            }
            Err(e) => assert!(e.to_string().contains("not"), "{key}: {e}"),
        }
    }
    assert_eq!(kept, 6);
    // The lease came back with o6 (if it survived): one more consumer and it is gone.
    if s.exists(b"o6").await.unwrap() {
        assert!(s.consumed(b"o6").await.unwrap(), "o6 had one consumer left");
    }
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}

#[tokio::test]
async fn after_a_crash_the_spilled_objects_survive() {
    let d = dir("crash");
    let e = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
    let s = open(&e, &d).await;
    for i in 0..8 {
        s.put(format!("o{i}").as_bytes(), &meta(data(i).len()), &data(i), Retention::Normal)
            .await
            .unwrap();
    }
    let spilled = s.stats().await.unwrap().spilled_objects;
    assert!(spilled >= 2);
    drop(s); // no shutdown: what was only in the pool is lost, the files stay
    let s = open(&e, &d).await;
    let st = s.stats().await.unwrap();
    assert_eq!(st.spilled_objects, spilled, "{st:?}");
    for i in 0..8 {
        if let Ok((_, bytes)) = s.get(format!("o{i}").as_bytes()).await {
            assert_eq!(bytes, data(i), "o{i}");
        }
    }
    // The store keeps working: new puts, and the old objects can be removed.
    s.put(b"new", &meta(10), &[1; 10], Retention::Normal).await.unwrap();
    for i in 0..8 {
        s.remove(format!("o{i}").as_bytes()).await.unwrap();
    }
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}
