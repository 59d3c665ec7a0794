#![no_main]
//! TCP data-frame headers: any bytes decode to a bounded header or an error, never a panic.
use libfuzzer_sys::fuzz_target;
use tensorwire_tcp::wire::{DataHeader, Kind, MAX_PIECE};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = DataHeader::decode(data) {
        assert!(h.payload_len() <= MAX_PIECE);
        assert!(h.kind == Kind::ReadReq || h.notice == 0, "only a READ carries a notice");
        assert_eq!(DataHeader::decode(&h.encode()).ok(), Some(h));
    }
});
