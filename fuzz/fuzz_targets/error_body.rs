#![no_main]
//! Error bodies a peer sends back: any bytes decode to an `Error` or a protocol error, never a
//! panic; relaying a decoded error again (encode, decode) changes nothing a user sees.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::error::{decode_error, encode_error};

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = decode_error(data) {
        let again = decode_error(&encode_error(&e)).expect("re-encoded error decodes");
        assert_eq!(again.to_string(), e.to_string());
    }
});
