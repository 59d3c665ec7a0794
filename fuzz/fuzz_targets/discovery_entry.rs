#![no_main]
//! Discovery entries as a registry stores them: any value decodes to an entry or an error, never
//! a panic; what decodes re-encodes to the same entry.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::discovery::Entry;

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = Entry::decode_value("store", "n1", data) {
        assert_eq!(Entry::decode_value("store", "n1", &e.encode_value()).ok(), Some(e));
    }
});
