#![no_main]
//! Orchestrator journal files: any bytes replay to a prefix of whole, checksummed records (a
//! torn or corrupt tail stops the replay, never a panic); every record decoded re-encodes to
//! the same bytes' fact; and the fold of what replayed, compacted, replays to the same book.
use libfuzzer_sys::fuzz_target;
use tensorwire_orchestrator::journal::{Book, Fact, replay};

fuzz_target!(|data: &[u8]| {
    let _ = Fact::decode_body(data);
    let r = replay(data);
    assert!(r.valid <= data.len());
    let mut book = Book::default();
    for f in &r.facts {
        assert_eq!(replay(&f.encode()).facts, vec![f.clone()]);
        book.apply(f);
    }
    let snap = book.snapshot_bytes();
    let mut again = Book::default();
    replay(&snap).facts.iter().for_each(|f| again.apply(f));
    assert_eq!(again, book);
});
