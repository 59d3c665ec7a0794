#![no_main]
//! NCCL backend control-channel messages (first byte: the frame kind, then the payload): any bytes decode
//! to a message of that kind or an error, never a panic, and a decoded message encodes to bytes
//! that decode to the same encoding.
use libfuzzer_sys::fuzz_target;
use tensorwire_nccl::wire::Msg;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, payload)) = data.split_first() else { return };
    if let Ok(m) = Msg::decode(kind, payload) {
        assert_eq!(m.kind(), kind);
        let enc = m.encode();
        let again = Msg::decode(kind, &enc).expect("an encoded message decodes");
        assert_eq!(again.encode(), enc);
    }
});
