#![no_main]
//! Handshake descriptors: decode never panics; whatever decodes re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::EngineDescriptor;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = EngineDescriptor::decode(data) {
        assert_eq!(d.encode(), data);
    }
});
