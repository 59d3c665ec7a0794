//! Where an object lives: rendezvous (highest-random-weight) hashing of its key over the nodes.
//! Every client computes the same order from the same membership with no coordination, and a
//! node that joins or leaves moves only the keys it ranks first for (about 1/n of them).
//!
//! The hash is written out here (FNV-1a over the node's id and the key, then a 64-bit
//! finalizer) rather than taken from `std`, whose hasher may change between Rust releases:
//! processes built by different toolchains must agree.

/// A store node's identity for placement: the address clients reach its RPC on, or the id it
/// registered under. Placement depends on nothing else.
pub type NodeId = String;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// splitmix64's finalizer: spreads FNV's weak low bits over the whole word.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The weight of `key` on `node`: the node with the highest weight is the key's first replica.
pub fn weight(node: &str, key: &[u8]) -> u64 {
    let h = fnv1a(0xcbf2_9ce4_8422_2325, node.as_bytes());
    // A separator byte, so that ("ab", "c") and ("a", "bc") hash apart.
    mix(fnv1a(fnv1a(h, &[0xff]), key))
}

/// `nodes` ordered for `key`: highest weight first (ties, which need equal ids, by id).
pub fn rank<'a>(key: &[u8], nodes: impl IntoIterator<Item = &'a NodeId>) -> Vec<&'a NodeId> {
    let mut v: Vec<(u64, &NodeId)> = nodes.into_iter().map(|n| (weight(n, key), n)).collect();
    v.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    v.into_iter().map(|(_, n)| n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: usize) -> Vec<NodeId> {
        (0..n).map(|i| format!("10.0.0.{i}:7000")).collect()
    }

    #[test]
    fn the_hash_is_fixed() {
        // Placement must agree across builds and releases: these values are part of the
        // protocol (computed independently, from the definition above).
        assert_eq!(weight("10.0.0.1:7000", b"embed/1"), 0x9695_31c8_780a_465b);
        assert_eq!(weight("n", b""), 0x75e2_4ab6_4fe7_ff54);
        assert_ne!(weight("ab", b"c"), weight("a", b"bc"));
    }

    #[test]
    fn keys_spread_evenly() {
        let nodes = ids(4);
        let mut first = [0usize; 4];
        for k in 0..40_000u32 {
            let top = rank(&k.to_le_bytes(), &nodes)[0];
            first[nodes.iter().position(|n| n == top).unwrap()] += 1;
        }
        // 10,000 expected each; a binomial's spread is about 87: 5% is far outside it.
        for n in first {
            assert!((9_500..10_500).contains(&n), "{first:?}");
        }
    }

    proptest! {
        /// Removing a node changes the order of the others for no key: a key moves only if it
        /// was on the node that left, and then to the next in its order.
        #[test]
        fn a_leaving_node_moves_only_its_keys(key in proptest::collection::vec(any::<u8>(), 1..32), n in 2usize..9, gone in 0usize..9) {
            let nodes = ids(n);
            let gone = &nodes[gone % n];
            let before: Vec<&NodeId> = rank(&key, &nodes).into_iter().filter(|x| *x != gone).collect();
            let rest: Vec<NodeId> = nodes.iter().filter(|x| *x != gone).cloned().collect();
            let after = rank(&key, &rest);
            prop_assert_eq!(before, after);
        }

        /// The order is a permutation and does not depend on the order nodes are listed in.
        #[test]
        fn order_is_a_function_of_the_set(key in proptest::collection::vec(any::<u8>(), 1..32), n in 1usize..9) {
            let nodes = ids(n);
            let mut reversed = nodes.clone();
            reversed.reverse();
            let a = rank(&key, &nodes);
            prop_assert_eq!(&a, &rank(&key, &reversed));
            let mut sorted: Vec<&NodeId> = a.clone();
            sorted.sort();
            prop_assert_eq!(sorted, nodes.iter().collect::<Vec<_>>());
        }
    }
}
