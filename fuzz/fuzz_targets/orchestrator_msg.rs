#![no_main]
//! Orchestrator service messages: any kind and body decode to a message or an error, never a
//! panic; what decodes re-encodes to the same message.
use libfuzzer_sys::fuzz_target;
use tensorwire_orchestrator::service::wire::{FRAMING, Msg};

fuzz_target!(|data: &[u8]| {
    let _ = FRAMING.decode(data);
    let Some((&kind, body)) = data.split_first() else { return };
    if let Ok(m) = Msg::decode(kind, body) {
        let again = m.encode().expect("a decoded message fits a frame");
        let (k, b) = FRAMING.decode(&again).expect("own frame decodes");
        assert_eq!(Msg::decode(k, b).ok(), Some(m));
    }
});
