#![no_main]
//! UCX control messages (active-message payloads): any bytes decode to a message or an error,
//! never a panic, and a decoded message encodes back to the bytes it came from.
use libfuzzer_sys::fuzz_target;
use tensorwire_ucx::wire::Msg;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode(data) {
        assert_eq!(m.encode(), data);
    }
});
