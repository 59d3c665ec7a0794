#![no_main]
//! Chunk plans from arbitrary tensors, dimensions and counts never panic, stay inside the tensor
//! (every range between its byte offset and the plan's extent) and cover it once.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::codec::Reader;
use tensorwire_core::{ChunkPlan, TensorMeta};

fuzz_target!(|data: &[u8]| {
    let [dim, a, b, c, d, rest @ ..] = data else { return };
    let dim = usize::from(*dim % 8);
    let count = u32::from_le_bytes([*a, *b, *c, *d]) % 64;
    let Ok(t) = TensorMeta::decode(&mut Reader::new(rest, "fuzz")) else { return };
    let Ok(p) = ChunkPlan::new(&t, dim, count) else { return };
    let mut covered = 0u64;
    for c in p.chunks() {
        for r in &c.ranges {
            assert!(r.offset >= t.byte_offset && r.end() <= p.extent());
            covered += r.len;
        }
    }
    assert_eq!(covered, t.nbytes().expect("a planned tensor has a size"));
});
