#![no_main]
//! Control-frame headers: any bytes decode to a header or an error, never a panic.
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::frame::FrameHeader;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = FrameHeader::decode(data) {
        assert_eq!(FrameHeader::decode(&h.encode()).ok(), Some(h));
    }
});
