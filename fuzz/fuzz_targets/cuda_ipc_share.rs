#![no_main]
//! The cuda backend's IPC share (what a grant carries to open a peer's device allocation): any
//! bytes decode to a non-empty, non-wrapping share or an error, never a panic; a decoded share
//! re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tensorwire_cuda::ipc::IpcShare;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = IpcShare::decode(data) {
        assert!(s.len > 0 && s.addr.checked_add(s.len).is_some());
        assert_eq!(&s.encode()[..], data);
    }
});
