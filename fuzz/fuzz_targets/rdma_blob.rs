#![no_main]
//! The RDMA backend's public blobs (first byte 0: an endpoint, else a region's keys): any bytes
//! decode to a blob or an error, never a panic, and a decoded blob round-trips.
use libfuzzer_sys::fuzz_target;
use tensorwire_rdma::blob::{Endpoint, RegionKeys};

fuzz_target!(|data: &[u8]| {
    let Some((&which, b)) = data.split_first() else { return };
    if which == 0 {
        if let Ok(e) = Endpoint::decode(b) {
            assert_eq!(Endpoint::decode(&e.encode()).expect("re-decodes"), e);
        }
    } else if let Ok(k) = RegionKeys::decode(b) {
        assert_eq!(k.encode(), b);
    }
});
