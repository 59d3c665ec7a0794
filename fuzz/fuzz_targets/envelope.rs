#![no_main]
//! Notification envelopes: decode never panics.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::envelope::Envelope;

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = Envelope::decode(data) {
        let _ = e.encode();
    }
});
