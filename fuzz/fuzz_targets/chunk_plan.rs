#![no_main]
//! Chunk plans from arbitrary tensors, dimensions and counts never panic, and stay inside the tensor.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::codec::Reader;
use tensorwire_core::{ChunkPlan, TensorMeta};

fuzz_target!(|data: &[u8]| {
    if data.len() < 5 {
        return;
    }
    let dim = data[0] as usize % 8;
    let count = u32::from_le_bytes([data[1], data[2], data[3], data[4]]) % 64;
    if let Ok(t) = TensorMeta::decode(&mut Reader::new(&data[5..], "fuzz")) {
        if let Ok(p) = ChunkPlan::new(&t, dim, count) {
            for c in p.chunks() {
                for r in &c.ranges {
                    assert!(r.end() <= p.extent());
                }
            }
        }
    }
});
