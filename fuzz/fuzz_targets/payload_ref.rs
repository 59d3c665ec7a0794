#![no_main]
//! Payload references: any bytes decode to a reference or an error, never a panic.
use libfuzzer_sys::fuzz_target;
use tensorwire_diffusion::PayloadRef;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = PayloadRef::from_bytes(data) {
        assert_eq!(PayloadRef::from_bytes(&p.to_bytes()).ok(), Some(p));
    }
});
