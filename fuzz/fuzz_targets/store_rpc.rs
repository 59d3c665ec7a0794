#![no_main]
//! Store node RPC frames: any bytes decode to a request, a response, a refusal or an error, never
//! a panic; what decodes re-encodes to a frame that decodes the same.
use libfuzzer_sys::fuzz_target;
use tensorwire_store::rpc::{FRAMING, Request, Response, frame, reply, split};

fuzz_target!(|data: &[u8]| {
    let Ok((kind, payload)) = FRAMING.decode(data) else { return };
    let Ok((req, body)) = split(payload) else { return };
    if let Ok(r) = Request::decode(kind, body) {
        let (k, b) = r.encode();
        let again = frame(k, req, &b).expect("a decoded request fits a frame");
        let (k2, p2) = FRAMING.decode(&again).expect("own frame decodes");
        let (req2, b2) = split(p2).expect("own payload splits");
        assert_eq!((k2, req2), (kind, req));
        assert_eq!(Request::decode(k2, b2).ok(), Some(r));
    }
    if let Ok(resp) = Response::decode(kind, body) {
        let again = reply(req, &resp).expect("a decoded response fits a frame");
        let (k2, p2) = FRAMING.decode(&again).expect("own frame decodes");
        let (_, b2) = split(p2).expect("own payload splits");
        match (resp, Response::decode(k2, b2).expect("own response decodes")) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            (a, b) => panic!("{a:?} came back as {b:?}"),
        }
    }
});
