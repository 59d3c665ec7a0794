#![no_main]
//! Connector control messages (they ride in engine notifications): any bytes decode to a message,
//! "not a connector message" or an error, never a panic; a decoded message re-encodes to the
//! same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_diffusion::control::Control;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(m)) = Control::decode(data) {
        assert_eq!(m.encode(), data);
    }
});
