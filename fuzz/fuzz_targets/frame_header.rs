#![no_main]
//! Frame headers and whole frames of every framed protocol (engine control, store RPC,
//! orchestrator service): any bytes decode to a frame or an error, never a panic; a decoded
//! header re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_proto::wire::frame::{CONTROL, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    for framing in
        [CONTROL, tensorwire_store::rpc::FRAMING, tensorwire_orchestrator::service::wire::FRAMING]
    {
        if let Ok(h) = framing.decode_header(data.get(..HEADER_LEN).unwrap_or(data)) {
            assert_eq!(&framing.header(h)[..], &data[..HEADER_LEN]);
        }
        if let Ok((kind, payload)) = framing.decode(data) {
            assert_eq!(framing.encode(kind, payload).expect("a decoded frame re-encodes"), data);
        }
    }
});
