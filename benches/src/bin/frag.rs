//! `frag`: how badly the store's allocator fragments under a mixed workload. A 1 GiB pool takes
//! objects of log-uniform sizes from 4 KiB to 64 MiB; whenever a put does not fit, random live
//! objects are removed until it does (about what eviction does, minus LRU order). After 100,000
//! puts it prints, as JSON, the bytes free, the largest block a put could still get, and their
//! ratio (1.0 = no fragmentation).
//!
//! `cargo run --release -p tensorwire-benches --bin frag`

use tensorwire_sim::rng::Rng;
use tensorwire_store::alloc::Allocator;

fn main() {
    let capacity = 1u64 << 30;
    let mut a = Allocator::new(capacity);
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<(u64, u64)> = Vec::new();
    let (mut puts, mut removals) = (0u64, 0u64);
    let mut worst_ratio = 1.0f64;
    for _ in 0..100_000 {
        // log-uniform between 2^12 and 2^26 bytes
        let exp = 12.0 + (rng.next_u64() % 14_000) as f64 / 1000.0;
        let len = 2f64.powf(exp) as u64;
        loop {
            if let Some(b) = a.alloc(len) {
                live.push(b);
                puts += 1;
                break;
            }
            let i = (rng.next_u64() % live.len() as u64) as usize;
            let (o, l) = live.swap_remove(i);
            a.free(o, l);
            removals += 1;
        }
        let free = capacity - a.used();
        if free >= 64 << 20 {
            worst_ratio = worst_ratio.min(a.largest_free() as f64 / free as f64);
        }
    }
    let free = capacity - a.used();
    println!(
        "{{\"pool\":{capacity},\"puts\":{puts},\"removals\":{removals},\"objects\":{},\"used\":{},\"free\":{free},\"largest_free\":{},\"largest_over_free\":{:.3},\"free_extents\":{},\"worst_largest_over_free_when_64MiB_free\":{:.3}}}",
        live.len(),
        a.used(),
        a.largest_free(),
        a.largest_free() as f64 / free.max(1) as f64,
        a.free_extents(),
        worst_ratio
    );
}
