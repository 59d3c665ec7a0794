#![no_main]
//! Handshake messages (Open, Challenge, Proof): decode never panics; what decodes re-encodes to
//! the same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::handshake::{Challenge, Open, Proof};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Open::decode(data) {
        assert_eq!(m.encode(), data);
    }
    if let Ok(m) = Challenge::decode(data) {
        assert_eq!(m.encode(), data);
    }
    if let Ok(m) = Proof::decode(data) {
        assert_eq!(m.encode(), data);
    }
});
