//! A denoise job resumes from its last step checkpoint: the first denoise worker runs steps,
//! saving a checkpoint (latents in the store, the reference to the orchestrator) every 3 steps,
//! and is killed (its connection drops) after step 6's; the item goes to another denoise
//! worker with the checkpoint, which loads the latents (checked), runs steps 6 to 10 only, and
//! the request completes with the right latents; when it ends the checkpoints are released.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensorwire_core::{DType, Engine, Permissions, TensorMeta, backend::MemBackend};
use tensorwire_diffusion::cache::{
    CheckpointOf, CheckpointRef, Checkpoints, Sampler, Shape, checkpoint_key, embedding_key,
};
use tensorwire_orchestrator::service::{
    Assignment, OrchestratorService, ServiceConfig, SubmitClient, WorkerClient,
};
use tensorwire_orchestrator::{Priority, Stage};
use tensorwire_store::{EmbeddedStore, Store, StoreConfig};
use tokio::sync::mpsc;

const N: u64 = 32 << 10;
const STEPS: u32 = 10;

fn meta() -> TensorMeta {
    TensorMeta::contiguous(DType::U8, &[N])
}

/// Runs a denoise item step by step from its checkpoint (if any), checkpointing every 3 steps;
/// says each step it ran on `steps`.
async fn denoise(
    w: &WorkerClient,
    a: &Assignment,
    ck: &Checkpoints,
    engine: &Engine,
    steps: &mpsc::Sender<(u64, u32)>,
    id: u64,
) -> Vec<u8> {
    let latent = engine.alloc(N, Permissions::NONE).await.unwrap();
    let mut from = 0;
    if let Some((step, data)) = &a.resume {
        let r = CheckpointRef::decode(data).unwrap();
        ck.load(&r, &latent, 0).await.unwrap();
        assert_eq!(
            latent.to_vec(0, N).unwrap(),
            vec![*step as u8; N as usize],
            "latents at {step}"
        );
        from = *step;
    }
    let prompt = embedding_key("t5", "1", "p", false, &[]);
    for step in from..STEPS {
        tokio::time::sleep(Duration::from_millis(20)).await;
        latent.write_bytes(0, &vec![(step + 1) as u8; N as usize]).unwrap();
        let _ = steps.send((id, step)).await;
        let done = step + 1;
        if done % 3 == 0 && done < STEPS {
            let key = checkpoint_key(&CheckpointOf {
                model: "m",
                sampler: Sampler { name: "euler", state: &[] },
                step: done,
                seed: a.request,
                guidance_scale: 5.0,
                shape: Shape { width: 8, height: 8, frames: 1 },
                prompt,
            });
            let r = ck
                .save(&key, &meta(), &latent.slice(0, N).unwrap(), done, b"sigmas")
                .await
                .unwrap();
            w.checkpoint(a, done, r.encode()).await.unwrap();
        }
    }
    assert_eq!(latent.to_vec(0, N).unwrap(), vec![STEPS as u8; N as usize]);
    b"latent".to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denoise_job_resumes_from_its_last_checkpoint_on_another_worker() {
    let engine = Engine::builder().backend(MemBackend::new()).start().await.unwrap();
    let store: Arc<dyn Store> =
        EmbeddedStore::new(&engine, StoreConfig { capacity: 8 << 20, ..StoreConfig::default() })
            .await
            .unwrap();
    let ck = Checkpoints::new(store.clone(), Duration::from_secs(600));
    let svc = OrchestratorService::serve("127.0.0.1:0".parse().unwrap(), ServiceConfig::default())
        .await
        .unwrap();
    let hb = Duration::from_millis(100);
    let (steps_tx, mut steps) = mpsc::channel(64);
    let released: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    // Encode and decode: trivial; decode also releases what the orchestrator hands out.
    for stage in [Stage::Encode, Stage::Decode] {
        let (w, mut rx) = WorkerClient::connect(svc.addr(), None, stage, 1, "h", hb).await.unwrap();
        let (ck, released) = (ck.clone(), released.clone());
        tokio::spawn(async move {
            while let Some(a) = rx.recv().await {
                if a.release_only {
                    for h in &a.held {
                        if CheckpointRef::is(h) {
                            ck.release(&CheckpointRef::decode(h).unwrap()).await.unwrap();
                        }
                        released.lock().push(h.clone());
                    }
                    w.released(&a).await.unwrap();
                    continue;
                }
                w.report_with(&a, Ok::<_, String>(format!("{:?}", a.stage).into_bytes()))
                    .await
                    .unwrap();
            }
        });
    }
    // The first denoise worker, which dies after step 6's checkpoint.
    let (first, mut rx) =
        WorkerClient::connect(svc.addr(), None, Stage::Denoise, 1, "h", hb).await.unwrap();
    let (e1, ck1, tx1) = (engine.clone(), ck.clone(), steps_tx.clone());
    let dies = tokio::spawn(async move {
        let a = rx.recv().await.unwrap();
        denoise(&first, &a, &ck1, &e1, &tx1, 1).await;
        unreachable!("killed before it finishes");
    });
    let sub = SubmitClient::connect(svc.addr(), None).await.unwrap();
    let out = sub.submit(7, Priority::Batch).await.unwrap();
    let mut ran = Vec::new();
    while let Some((id, step)) = steps.recv().await {
        ran.push((id, step));
        if step == 7 {
            break; // step 6's checkpoint is out; step 7 ran: kill it mid-job
        }
    }
    dies.abort();
    let _ = dies.await; // the worker client dropped: its connection closes, the item re-queues
    let (second, mut rx) =
        WorkerClient::connect(svc.addr(), None, Stage::Denoise, 1, "h", hb).await.unwrap();
    let (e2, ck2) = (engine.clone(), ck.clone());
    tokio::spawn(async move {
        while let Some(a) = rx.recv().await {
            if a.release_only {
                second.released(&a).await.unwrap();
                continue;
            }
            assert_eq!(a.resume.as_ref().map(|(s, _)| *s), Some(6), "resumes from step 6");
            let out = denoise(&second, &a, &ck2, &e2, &steps_tx, 2).await;
            second.report_with(&a, Ok::<_, String>(out)).await.unwrap();
        }
    });
    let r = tokio::time::timeout(Duration::from_secs(20), out).await.unwrap().unwrap();
    assert!(r.is_ok(), "{r:?}");
    while let Ok((id, step)) = steps.try_recv() {
        ran.push((id, step));
    }
    let second_ran: Vec<u32> = ran.iter().filter(|(id, _)| *id == 2).map(|(_, s)| *s).collect();
    assert_eq!(second_ran, (6..STEPS).collect::<Vec<_>>(), "only the steps after the checkpoint");
    // When the request ended its checkpoints were released: gone from the store.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cks: Vec<Vec<u8>> =
        released.lock().iter().filter(|h| CheckpointRef::is(h)).cloned().collect();
    assert!(cks.len() >= 2, "checkpoints at steps 3 and 6 (and 9) released: {}", cks.len());
    for h in cks {
        let r = CheckpointRef::decode(&h).unwrap();
        assert!(!store.exists(&r.key).await.unwrap(), "released checkpoint still stored");
    }
    assert_eq!(svc.stats().await.unwrap().duplicated, 0);
}
