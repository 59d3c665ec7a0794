#![no_main]
//! Queue messages: any bytes decode to a message or an error, never a panic; what decodes
//! re-encodes to something that decodes the same.
use libfuzzer_sys::fuzz_target;
use tensorwire_orchestrator::QueueMessage;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = QueueMessage::decode(data) {
        let again = m.encode().expect("a decoded message is within bounds");
        assert_eq!(QueueMessage::decode(&again).ok(), Some(m));
    }
});
