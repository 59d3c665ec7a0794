//! The diffusion layer's plain parts: connector control messages and the lease state machine.
//! The control codec round-trips and its decoder is total (proptest).

use std::time::{Duration, Instant};

use proptest::prelude::*;
use tensorwire_diffusion::control::{Control, FRAMING, Gone};
use tensorwire_diffusion::{Lease, LeasePolicy, LeaseState};

#[test]
fn control_round_trip() {
    let all = [
        Control::Subscribe { payload: 1, hold_ms: 30_000 },
        Control::Done { payload: 5, consumed: false },
        Control::Ready { payload: 3, index: 6, crc: Some(9) },
        Control::Ready { payload: 3, index: 6, crc: None },
        Control::Done { payload: 2, consumed: true },
    ]
    .into_iter()
    .chain(
        [Gone::NotPublished, Gone::Consumed, Gone::Expired, Gone::Retired, Gone::Abandoned]
            .map(|why| Control::Gone { payload: 4, why }),
    );
    for m in all {
        assert_eq!(Control::decode(&m.encode()).unwrap(), Some(m));
    }
    assert!(Control::decode(b"user payload").unwrap().is_none());
}

#[test]
fn lease_transitions() {
    let t0 = Instant::now();
    let mut l = Lease::new(LeasePolicy::DeleteOnConsume { consumers: 2 }, t0);
    assert_eq!(l.consume(t0), LeaseState::Live);
    assert_eq!(l.consume(t0), LeaseState::Consumed);
    assert_eq!(l.state(t0), LeaseState::Consumed);
    let mut l = Lease::new(LeasePolicy::Ttl(Duration::from_secs(1)), t0);
    assert_eq!(l.state(t0 + Duration::from_millis(999)), LeaseState::Live);
    assert_eq!(l.state(t0 + Duration::from_secs(1)), LeaseState::Expired);
    assert_eq!(l.consume(t0 + Duration::from_secs(2)), LeaseState::Expired);
    let mut l = Lease::new(LeasePolicy::Pinned, t0);
    assert_eq!(l.consume(t0 + Duration::from_secs(9999)), LeaseState::Live);
}

proptest! {
    #[test]
    fn control_decode_is_total(mut bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = Control::decode(&bytes);
        // The current prefix, so the body's decoder is reached (not only the version check).
        if bytes.len() >= 3 {
            bytes[..2].copy_from_slice(&FRAMING.magic);
            bytes[2] = FRAMING.version;
        }
        let _ = Control::decode(&bytes);
    }

    /// A lease never comes back to life, DeleteOnConsume{n} is consumed exactly at the n-th
    /// consume, and Ttl leases never end before their time.
    #[test]
    fn lease_is_monotone(n in 1u32..5, ttl in 1u64..1000, steps in proptest::collection::vec((any::<bool>(), 0u64..200), 0..40)) {
        let t0 = Instant::now();
        for policy in [LeasePolicy::DeleteOnConsume { consumers: n }, LeasePolicy::Ttl(Duration::from_millis(ttl))] {
            let mut l = Lease::new(policy, t0);
            let (mut now, mut consumed, mut ended) = (t0, 0u32, false);
            for &(consume, dt) in &steps {
                now += Duration::from_millis(dt);
                let s = if consume { consumed += 1; l.consume(now) } else { l.state(now) };
                if ended { prop_assert!(s != LeaseState::Live, "revived"); }
                if s != LeaseState::Live { ended = true; }
                match policy {
                    LeasePolicy::DeleteOnConsume { .. } => prop_assert_eq!(s == LeaseState::Consumed, consumed >= n),
                    _ => prop_assert_eq!(s == LeaseState::Expired, now >= t0 + Duration::from_millis(ttl)),
                }
            }
        }
    }
}
