//! The repair and rebalance planner, apart from any IO: the live nodes and which of them hold
//! each object go in, the copies and deletions that restore `replicas` copies on each object's
//! placement come out.
//!
//! For each object, its placement is the first `replicas` live nodes in its rendezvous order.
//! - A placement node without a copy gets one, copied from a live holder (a node that died took
//!   its copies with it; a node that joined takes over its share this way).
//! - A holder outside the placement loses its copy, but only once every placement node holds
//!   one: a deletion never takes an object below its placement's copies, so no object loses its
//!   last replica to a plan, whatever copies fail.
//! - Copies are bounded per plan (bytes, and at least one copy so that a large object still
//!   moves): what does not fit is planned next time. Applying a plan and planning again
//!   converges: two rounds with room for every copy leave nothing to do.

use std::collections::{BTreeMap, BTreeSet};

use super::placement::{NodeId, rank};

/// What the planner knows of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    /// Its length in bytes (copies are bounded by bytes).
    pub len: u64,
    /// The live nodes that hold a copy.
    pub on: BTreeSet<NodeId>,
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Copy `key` from node `from` to node `to`.
    Copy {
        /// The object.
        key: Vec<u8>,
        /// A node that holds it.
        from: NodeId,
        /// A placement node that does not.
        to: NodeId,
        /// Its length.
        len: u64,
    },
    /// Delete the copy of `key` on `node` (outside its placement, which holds it in full).
    Delete {
        /// The object.
        key: Vec<u8>,
        /// The node.
        node: NodeId,
    },
}

/// A plan: its actions, and how many copies waited for a later plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Copies first, then deletions.
    pub actions: Vec<Action>,
    /// Copies that did not fit in the byte budget.
    pub deferred: usize,
}

/// The first `replicas` of `live` in `key`'s order.
pub fn placement<'a>(key: &[u8], live: &'a BTreeSet<NodeId>, replicas: usize) -> Vec<&'a NodeId> {
    let mut r = rank(key, live);
    r.truncate(replicas.max(1));
    r
}

/// Plans copies (at most `budget` bytes of them, and at least one) and deletions that bring
/// every object to `replicas` copies on its placement among `live`. Holders outside `live` are
/// ignored: they are gone, or unreachable, and must not count as copies.
pub fn plan(
    live: &BTreeSet<NodeId>,
    objects: &BTreeMap<Vec<u8>, Holding>,
    replicas: usize,
    budget: u64,
) -> Plan {
    let mut p = Plan::default();
    let mut deletes = Vec::new();
    let mut spent = 0u64;
    for (key, h) in objects {
        let on: Vec<&NodeId> = h.on.iter().filter(|n| live.contains(*n)).collect();
        let Some(&source) = on.first() else { continue };
        let want = placement(key, live, replicas);
        let missing: Vec<&NodeId> = want.iter().copied().filter(|n| !h.on.contains(*n)).collect();
        // The copy comes from the best-placed holder (a placement node when one has it).
        let from = want.iter().copied().find(|n| h.on.contains(*n)).unwrap_or(source);
        for to in &missing {
            if spent > 0 && spent.saturating_add(h.len) > budget {
                p.deferred += 1;
                continue;
            }
            spent = spent.saturating_add(h.len);
            p.actions.push(Action::Copy {
                key: key.clone(),
                from: from.clone(),
                to: (*to).clone(),
                len: h.len,
            });
        }
        if missing.is_empty() {
            for n in on.into_iter().filter(|n| !want.contains(n)) {
                deletes.push(Action::Delete { key: key.clone(), node: n.clone() });
            }
        }
    }
    p.actions.extend(deletes);
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(i: u8) -> NodeId {
        format!("n{i}")
    }

    /// Membership (a bit per node of 6) and objects (each a set of holders among all 6).
    fn world() -> impl Strategy<Value = (BTreeSet<NodeId>, BTreeMap<Vec<u8>, Holding>, usize)> {
        let live = proptest::bits::u8::between(0, 6);
        let objs = proptest::collection::vec((proptest::bits::u8::between(0, 6), 1u64..100), 0..40);
        (live, objs, 1usize..4).prop_map(|(live, objs, r)| {
            let live: BTreeSet<NodeId> =
                (0..6).filter(|i| live & (1 << i) != 0).map(node).collect();
            let objects = objs
                .into_iter()
                .enumerate()
                .map(|(i, (on, len))| {
                    let on = (0..6).filter(|b| on & (1 << b) != 0).map(node).collect();
                    (format!("k{i}").into_bytes(), Holding { len, on })
                })
                .collect();
            (live, objects, r)
        })
    }

    fn live_holders(h: &Holding, live: &BTreeSet<NodeId>) -> usize {
        h.on.iter().filter(|n| live.contains(*n)).count()
    }

    /// Carries out `actions` (copies where `ok` says, every deletion) on `objects`.
    fn apply(
        objects: &mut BTreeMap<Vec<u8>, Holding>,
        actions: &[Action],
        ok: impl Fn(usize) -> bool,
    ) {
        for (i, a) in actions.iter().enumerate() {
            match a {
                Action::Copy { key, from, to, .. } => {
                    let h = objects.get_mut(key).unwrap();
                    assert!(h.on.contains(from), "a copy from a node without the object");
                    if ok(i) {
                        h.on.insert(to.clone());
                    }
                }
                Action::Delete { key, node } => {
                    objects.get_mut(key).unwrap().on.remove(node);
                }
            }
        }
    }

    proptest! {
        /// Whatever copies fail, no object with a live copy loses its last one, and none drops
        /// below the copies its placement held.
        #[test]
        fn never_loses_a_last_replica((live, mut objects, r) in world(), fail in any::<u64>()) {
            let before = objects.clone();
            let p = plan(&live, &objects, r, u64::MAX);
            apply(&mut objects, &p.actions, |i| fail & (1 << (i % 64)) == 0);
            for (k, h) in &objects {
                let was = &before[k];
                if live_holders(was, &live) > 0 {
                    prop_assert!(live_holders(h, &live) > 0, "{k:?} lost");
                }
                let want = placement(k, &live, r);
                let held = |o: &Holding| want.iter().filter(|n| o.on.contains(**n)).count();
                prop_assert!(held(h) >= held(was));
            }
        }

        /// Two rounds with every copy done reach the fixed point: each object with a live copy
        /// is on exactly its placement, and a third plan is empty.
        #[test]
        fn converges((live, mut objects, r) in world()) {
            for _ in 0..2 {
                let p = plan(&live, &objects, r, u64::MAX);
                apply(&mut objects, &p.actions, |_| true);
            }
            prop_assert_eq!(plan(&live, &objects, r, u64::MAX), Plan::default());
            for (k, h) in &objects {
                if live_holders(h, &live) == 0 {
                    continue;
                }
                let want: BTreeSet<NodeId> = placement(k, &live, r).into_iter().cloned().collect();
                let on: BTreeSet<NodeId> = h.on.iter().filter(|n| live.contains(*n)).cloned().collect();
                prop_assert_eq!(on, want);
            }
        }

        /// A plan's copies fit the budget, except that one copy always goes; with a small
        /// budget repeated plans still converge.
        #[test]
        fn copies_respect_the_budget((live, mut objects, r) in world(), budget in 1u64..300) {
            for _ in 0..400 {
                let p = plan(&live, &objects, r, budget);
                let copies: Vec<u64> = p.actions.iter().filter_map(|a| match a {
                    Action::Copy { len, .. } => Some(*len),
                    Action::Delete { .. } => None,
                }).collect();
                prop_assert!(copies.len() <= 1 || copies.iter().sum::<u64>() <= budget);
                if p == Plan::default() {
                    return Ok(());
                }
                apply(&mut objects, &p.actions, |_| true);
            }
            prop_assert!(false, "no fixed point after 400 plans");
        }
    }

    #[test]
    fn the_budget_is_filled_exactly_and_what_is_left_counted() {
        // Three objects of 10 bytes, each missing its copy on a new node: a budget of 20 takes
        // two copies (exactly the budget) and leaves one for the next plan.
        let live: BTreeSet<NodeId> = [node(0)].into();
        let objects: BTreeMap<Vec<u8>, Holding> =
            (0..3).map(|i| (vec![i], Holding { len: 10, on: BTreeSet::new() })).collect();
        // No live holder: nothing to copy from, nothing planned.
        assert_eq!(plan(&live, &objects, 1, 20), Plan::default());
        let two: BTreeSet<NodeId> = [node(0), node(1)].into();
        let held: BTreeMap<Vec<u8>, Holding> = objects
            .keys()
            .map(|k| (k.clone(), Holding { len: 10, on: [node(0)].into() }))
            .collect();
        let p = plan(&two, &held, 2, 20);
        assert_eq!(p.actions.len(), 2, "{p:?}");
        assert_eq!(p.deferred, 1);
        assert_eq!(plan(&two, &held, 2, 19).deferred, 2, "one copy always goes");
    }

    #[test]
    fn a_dead_node_is_replaced_and_a_joined_one_takes_its_share() {
        let all: BTreeSet<NodeId> = (0..3).map(node).collect();
        let key = b"embed/7".to_vec();
        let want = placement(&key, &all, 2);
        let (first, second) = (want[0].clone(), want[1].clone());
        let third = all.iter().find(|n| !want.contains(n)).unwrap().clone();
        // The first replica's node died: its placement now includes the third node.
        let live: BTreeSet<NodeId> = all.iter().filter(|n| **n != first).cloned().collect();
        let objects = BTreeMap::from([(
            key.clone(),
            Holding { len: 10, on: BTreeSet::from([first.clone(), second.clone()]) },
        )]);
        let p = plan(&live, &objects, 2, u64::MAX);
        assert_eq!(
            p.actions,
            vec![Action::Copy {
                key: key.clone(),
                from: second.clone(),
                to: third.clone(),
                len: 10
            }]
        );
        // It comes back (empty): it takes its copy back, and then the third node's goes.
        let mut objects = objects;
        objects.get_mut(&key).unwrap().on = BTreeSet::from([second.clone(), third.clone()]);
        let p = plan(&all, &objects, 2, u64::MAX);
        assert_eq!(
            p.actions,
            vec![Action::Copy { key: key.clone(), from: second, to: first, len: 10 }]
        );
        apply(&mut objects, &p.actions, |_| true);
        let p = plan(&all, &objects, 2, u64::MAX);
        assert_eq!(p.actions, vec![Action::Delete { key, node: third }]);
    }
}
