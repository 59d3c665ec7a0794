//! Moves a Wan2.1 latent ([16, 21, 60, 104] bf16, 4 MiB) between two engines in 7 temporal chunks,
//! the way a denoise worker hands its output to a VAE decoder: the producer marks each chunk ready as
//! it is "produced", the consumer handles each chunk as soon as it lands. Prints every chunk and its
//! byte ranges, then checks every byte.
//!
//! `cargo run --release -p tensorwire-core --example chunked_handoff`

#[cfg(not(loom))]
use std::time::{Duration, Instant};

#[cfg(not(loom))]
use tensorwire_core::{
    ChunkPlan, DType, Engine, Permissions, Result, TensorMeta, backend::MemBackend,
};

#[cfg(loom)]
fn main() {} // the loom build has no engine

#[cfg(not(loom))]
#[tokio::main]
async fn main() -> Result<()> {
    let denoise = Engine::builder().backend(MemBackend::new()).start().await?;
    let decode = Engine::builder().backend(MemBackend::new()).start().await?;
    println!("denoise engine {} on {}", denoise.id(), denoise.local_addr());
    println!("decode  engine {} on {}", decode.id(), decode.local_addr());

    let meta = TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]);
    let bytes = meta.nbytes()?;
    let plan = ChunkPlan::new(&meta, 1, 7)?;
    println!(
        "latent {:?} {:?}: {bytes} bytes, {} chunks along T (dim {})",
        meta.shape,
        meta.dtype,
        plan.len(),
        plan.dim()
    );

    // The producer's output buffer, filled with a recognisable pattern.
    let latent = denoise.alloc(bytes, Permissions::NONE).await?;
    let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    latent.write_bytes(0, &data)?;
    // The consumer's destination, writable by peers.
    let dst = decode.alloc(bytes, Permissions::WRITE).await?;

    let mut stream = decode.expect_chunks(plan.clone(), &dst, 0)?;
    let session = denoise.connect(decode.local_addr()).await?;
    let sender = session.chunk_sender(stream.transfer_id(), plan, &latent, 0, &dst.remote(), 0)?;

    let start = Instant::now();
    let producer = tokio::spawn(async move {
        for i in 0..7 {
            tokio::time::sleep(Duration::from_millis(20)).await; // "denoising" chunk i
            sender.mark_ready(i)?;
        }
        sender.finish().await
    });
    while let Some(chunk) = stream.next().await? {
        let first = chunk.ranges[0];
        let last = chunk.ranges[chunk.ranges.len() - 1];
        println!(
            "{:>7.1} ms  chunk {} landed: T {}..{}, {} byte ranges ({}..{} .. {}..{}), {} bytes",
            start.elapsed().as_secs_f64() * 1e3,
            chunk.index,
            chunk.start,
            chunk.end,
            chunk.ranges.len(),
            first.offset,
            first.end(),
            last.offset,
            last.end(),
            chunk.ranges.iter().map(|r| r.len).sum::<u64>()
        );
    }
    producer.await.map_err(|e| tensorwire_core::Error::protocol(e.to_string()))??;
    println!("end of tensor after {:.1} ms", start.elapsed().as_secs_f64() * 1e3);

    let got = dst.to_vec(0, bytes)?;
    assert!(got == data, "bytes differ");
    let stats = denoise.stats();
    println!(
        "verified {bytes} bytes; the producer engine wrote {} bytes in {} ops",
        stats.bytes_written, stats.ops_ok
    );
    Ok(())
}
