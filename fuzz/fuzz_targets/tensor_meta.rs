#![no_main]
//! Tensor metadata: decode, validation and DLPack conversion never panic.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::codec::Reader;
use tensorwire_core::{MemoryKind, TensorMeta};

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = TensorMeta::decode(&mut Reader::new(data, "fuzz")) {
        let _ = t.validate_for(u64::MAX, MemoryKind::Host);
        let _ = TensorMeta::from_dlpack(&t.to_dlpack());
    }
});
