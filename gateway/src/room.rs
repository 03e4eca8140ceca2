//! Whether the pool has room, asked of a pool view: what placement decides for it, the routes
//! no member can take (and why), and whether it would place one more new instance. Pure, and
//! worked out once per view (memoized in it); asked by the coordinator, by registrations on
//! every replica, and by the Kubernetes status and Events.

use std::collections::BTreeMap;

use crate::operations;
use crate::placement::{self, Decision};
use crate::pool::View;

/// What placement decides for `view`: the desired instances, their owners and the live
/// members that may take them (drained and leaving ones take nothing new). Pure.
pub fn decisions(view: &View) -> Vec<Decision> {
    placement::plan(
        &view.desired(),
        &view.owners(),
        &view.candidates(&operations::drained(view)),
    )
}

/// The routes no member can take in `view`, with placement's reason. Pure; worked out once per
/// view (memoized in it).
pub fn unplaced(view: &View) -> &BTreeMap<String, String> {
    view.unplaced.get_or_init(|| {
        decisions(view)
            .into_iter()
            .filter_map(|d| match d {
                Decision::Unplaced { route, reason } => Some((route, reason)),
                _ => None,
            })
            .collect()
    })
}

/// Whether `view` would place one more new instance: nothing desired is unplaced, and the
/// members that take instances have more free slots than there are routes still to place.
/// Worked out once per view (memoized in it).
pub fn takes_one_more(view: &View) -> bool {
    *view.room.get_or_init(|| {
        if !unplaced(view).is_empty() {
            return false;
        }
        let mut load: BTreeMap<&str, usize> = BTreeMap::new();
        let mut pending = 0usize;
        for route in view.desired() {
            match view.current_assignment(&route) {
                Some(a) => *load.entry(a.member.as_str()).or_default() += 1,
                None => pending += 1,
            }
        }
        let free: usize = view
            .candidates(&operations::drained(view))
            .iter()
            .filter(|c| !c.excluded)
            .map(|c| {
                c.capacity
                    .saturating_sub(load.get(c.member.as_str()).copied().unwrap_or(0))
            })
            .sum();
        free > pending
    })
}
