#![no_main]
//! Error bodies a peer sends back: any bytes decode to an `Error` or a protocol error, never a panic.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::error::{decode_error, encode_error};

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = decode_error(data) {
        let _ = decode_error(&encode_error(&e)).expect("re-encoded error decodes");
    }
});
