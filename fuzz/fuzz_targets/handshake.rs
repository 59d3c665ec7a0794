#![no_main]
//! Handshake messages (Open, Challenge, Hello): decode never panics.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::handshake::{Challenge, Hello, Open};

fuzz_target!(|data: &[u8]| {
    let _ = Open::decode(data);
    let _ = Challenge::decode(data);
    let _ = Hello::decode(data);
});
