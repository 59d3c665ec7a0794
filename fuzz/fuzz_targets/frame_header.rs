#![no_main]
//! Frame headers of every framed protocol (control, store rpc, orchestrator): any bytes decode to
//! a header or an error, never a panic; a decoded header re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::frame::CONTROL;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = CONTROL.decode_header(data) {
        assert_eq!(&CONTROL.header(h)[..], data);
    }
    let _ = CONTROL.decode(data);
});
