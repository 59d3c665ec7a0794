#![no_main]
//! Orchestrator service messages: any header and payload decode to a message or an error, never a
//! panic; what decodes re-encodes to the same message.
use libfuzzer_sys::fuzz_target;
use tensorwire_diffusion::service::wire::{HEADER_LEN, Msg};

fuzz_target!(|data: &[u8]| {
    let _ = Msg::header(data.get(..HEADER_LEN).unwrap_or(data));
    if let Some((&kind, payload)) = data.split_first() {
        if let Ok(m) = Msg::decode(kind, payload) {
            let again = m.encode();
            let (k, _) = Msg::header(&again[..HEADER_LEN]).expect("own header decodes");
            assert_eq!(Msg::decode(k, &again[HEADER_LEN..]).ok(), Some(m));
        }
    }
});
