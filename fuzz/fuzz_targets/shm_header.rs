#![no_main]
//! Shared-memory backend headers: any bytes decode to a bounded header or an error, never a
//! panic; a decoded header re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::backend::kit::MAX_NOTIFY_WIRE;
use tensorwire_shm::wire::Header;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert!(h.body_len() <= MAX_NOTIFY_WIRE as u64);
        assert_eq!(&h.encode()[..], data);
    }
});
