//! Placement and failed-owner recovery decisions: pure functions over plain
//! data, tested without I/O. The coordinator feeds them the pool as read from
//! the store and writes what they decide through `write_fenced`.
//!
//! Rules: healthy assignments stay where they are (stable); a new instance
//! goes to the least-loaded eligible member (ties by name), never beyond the
//! member's capacity or [`MAX_INSTANCES_PER_MEMBER`]; an instance whose owner
//! process is gone moves to another member at term + 1; an instance whose
//! route another workload registered since (a Pod recreated under the same
//! name) is placed anew, as if new, at term + 1; an instance nobody can take
//! is reported with the reason.

use std::collections::{BTreeMap, BTreeSet};

use crate::store::OwnershipTerm;

/// Hard cap of instances per member, whatever a member offers.
pub const MAX_INSTANCES_PER_MEMBER: usize = proto::MAX_INSTANCES_PER_MEMBER as usize;

/// A member process as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub member: String,
    pub process_id: String,
    pub capacity: usize,
    /// Announced leaving, or drained by an operator: takes nothing new.
    pub excluded: bool,
}

/// Who owns a route now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub member: String,
    pub process_id: String,
    pub term: OwnershipTerm,
    /// The owner reported it cannot run the instance at this term (a refused
    /// grant or activation, or it acknowledged the term without hosting it), or the term is
    /// below the route's last one (the sidecar's fence is above it: nobody can take it up).
    pub failed: bool,
    /// The assignment was made for an older workload of the route (another Pod UID
    /// registered since): it says nothing about the current one.
    pub stale: bool,
}

/// What placement decided for one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// First placement at term 1.
    Place { route: String, to: Candidate },
    /// The owner process is gone: move to `to` at `term` (old term + 1).
    Recover {
        route: String,
        from: Owner,
        to: Candidate,
        term: OwnershipTerm,
    },
    /// Another workload registered the route since the assignment was made: place the new
    /// one as if new, on `to` at `term` (the stale term + 1, so terms never repeat).
    Replace {
        route: String,
        from: Owner,
        to: Candidate,
        term: OwnershipTerm,
    },
    /// The instance is no longer desired (withdrawn, ended): drop the assignment at once,
    /// whether or not its owner lives (a live owner releases the session).
    Withdraw { route: String, term: OwnershipTerm },
    /// No member can take the route.
    Unplaced { route: String, reason: String },
}

impl Decision {
    /// The route decided on.
    pub fn route(&self) -> &str {
        match self {
            Self::Place { route, .. }
            | Self::Recover { route, .. }
            | Self::Replace { route, .. }
            | Self::Withdraw { route, .. }
            | Self::Unplaced { route, .. } => route,
        }
    }
}

/// Plan one reconcile round.
///
/// - `desired`: routes of the desired instances;
/// - `owners`: current assignments by route;
/// - `live`: member processes with a live membership record.
///
/// Deterministic: the same input always gives the same plan.
pub fn plan(desired: &BTreeSet<String>, owners: &BTreeMap<String, Owner>, live: &[Candidate]) -> Vec<Decision> {
    let alive = |o: &Owner| {
        live.iter()
            .any(|c| c.member == o.member && c.process_id == o.process_id)
    };
    // Load counts the desired instances a live process holds. A withdrawn or
    // ended instance's assignment is dropped at once (its owner lets the
    // session go) and a stale one is released: neither counts.
    let mut load: BTreeMap<String, usize> = live.iter().map(|c| (c.member.clone(), 0)).collect();
    for (route, owner) in owners {
        if alive(owner)
            && !owner.stale
            && desired.contains(route)
            && let Some(n) = load.get_mut(&owner.member)
        {
            *n += 1;
        }
    }
    let mut decisions = Vec::new();
    for (route, owner) in owners {
        if !desired.contains(route) {
            decisions.push(Decision::Withdraw {
                route: route.clone(),
                term: owner.term,
            });
        }
    }
    for route in desired {
        let owner = owners.get(route);
        if owner.is_some_and(|o| alive(o) && !o.failed && !o.stale) {
            continue;
        }
        // The member of an owner that failed the term, or whose process is gone, is passed
        // over when others can take the route: a process of that name just failed it or died
        // (it may be restarting in a loop), and a new process of the name holds nothing of the
        // old one's.
        let others: Vec<Candidate> = match owner.filter(|o| !o.stale && (o.failed || !alive(o))) {
            Some(passed_over) => live
                .iter()
                .filter(|c| c.member != passed_over.member)
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        let pick_from = if others.iter().any(|c| !c.excluded) {
            others.as_slice()
        } else {
            live
        };
        if let Some(failed) = owner.filter(|o| o.failed && !o.stale && alive(o))
            && let Some(n) = load.get_mut(&failed.member)
        {
            *n = n.saturating_sub(1);
        }
        // Others full or none open: the passed-over member takes it again rather than nobody
        // (a live owner that gave its term up has room: its load was just given back).
        let picked = match least_loaded(pick_from, &load) {
            Err(_) if !std::ptr::eq(pick_from, live) => least_loaded(live, &load),
            picked => picked,
        };
        match picked {
            Ok(to) => {
                *load.entry(to.member.clone()).or_default() += 1;
                decisions.push(match owner {
                    None => Decision::Place {
                        route: route.clone(),
                        to: to.clone(),
                    },
                    Some(from) if from.stale => Decision::Replace {
                        route: route.clone(),
                        from: from.clone(),
                        to: to.clone(),
                        term: from.term.next(),
                    },
                    Some(from) => Decision::Recover {
                        route: route.clone(),
                        from: from.clone(),
                        to: to.clone(),
                        term: from.term.next(),
                    },
                });
            }
            Err(reason) => decisions.push(Decision::Unplaced {
                route: route.clone(),
                reason,
            }),
        }
    }
    decisions
}

/// The eligible member with the fewest instances (ties by name), or why none is.
pub(crate) fn least_loaded<'a>(live: &'a [Candidate], load: &BTreeMap<String, usize>) -> Result<&'a Candidate, String> {
    if live.is_empty() {
        return Err("no live pool members".into());
    }
    let open: Vec<&Candidate> = live.iter().filter(|c| !c.excluded).collect();
    if open.is_empty() {
        return Err(format!("all {} pool members are leaving or drained", live.len()));
    }
    open.iter()
        .filter(|c| load.get(&c.member).copied().unwrap_or(0) < limit(c))
        .min_by_key(|c| (load.get(&c.member).copied().unwrap_or(0), c.member.as_str()))
        .copied()
        .ok_or_else(|| {
            let limits: Vec<String> = open
                .iter()
                .map(|c| {
                    let held = load.get(&c.member).copied().unwrap_or(0);
                    format!("{} holds {held} of {}", c.member, limit(c))
                })
                .collect();
            format!(
                "all {} eligible pool members are at capacity ({})",
                open.len(),
                limits.join(", ")
            )
        })
}

fn limit(c: &Candidate) -> usize {
    c.capacity.min(MAX_INSTANCES_PER_MEMBER)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str) -> Candidate {
        Candidate {
            member: name.into(),
            process_id: format!("{name}-p1"),
            capacity: 256,
            excluded: false,
        }
    }

    fn routes(n: usize) -> BTreeSet<String> {
        (0..n).map(|i| format!("ns/agent-{i:02}")).collect()
    }

    fn owner(member: &str, term: u64) -> Owner {
        Owner {
            member: member.into(),
            process_id: format!("{member}-p1"),
            term: OwnershipTerm::new(term),
            failed: false,
            stale: false,
        }
    }

    /// Apply a plan's placements to an owner map, as the coordinator would.
    fn apply(owners: &mut BTreeMap<String, Owner>, plan: &[Decision]) {
        for d in plan {
            match d {
                Decision::Place { route, to } => {
                    owners.insert(
                        route.clone(),
                        Owner {
                            member: to.member.clone(),
                            process_id: to.process_id.clone(),
                            term: OwnershipTerm::new(1),
                            failed: false,
                            stale: false,
                        },
                    );
                }
                Decision::Recover { route, to, term, .. } | Decision::Replace { route, to, term, .. } => {
                    owners.insert(
                        route.clone(),
                        Owner {
                            member: to.member.clone(),
                            process_id: to.process_id.clone(),
                            term: *term,
                            failed: false,
                            stale: false,
                        },
                    );
                }
                Decision::Withdraw { route, .. } => {
                    owners.remove(route);
                }
                Decision::Unplaced { .. } => {}
            }
        }
    }

    fn per_member(owners: &BTreeMap<String, Owner>) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for o in owners.values() {
            *counts.entry(o.member.clone()).or_default() += 1;
        }
        counts
    }

    #[test]
    fn new_instances_spread_evenly() {
        let live = [member("a"), member("b"), member("c")];
        let mut owners = BTreeMap::new();
        let decisions = plan(&routes(9), &owners, &live);
        apply(&mut owners, &decisions);
        assert_eq!(per_member(&owners).values().copied().collect::<Vec<_>>(), vec![3, 3, 3]);
        assert!(owners.values().all(|o| o.term == OwnershipTerm::new(1)));
    }

    #[test]
    fn healthy_assignments_stay_put() {
        let live = [member("a"), member("b")];
        let mut owners: BTreeMap<String, Owner> = routes(4).into_iter().map(|r| (r, owner("a", 3))).collect();
        // b is idle, but nothing moves: placement is stable.
        let decisions = plan(&routes(4), &owners, &live);
        assert!(decisions.is_empty(), "{decisions:?}");
        // A new instance goes to the least-loaded member.
        let mut desired = routes(4);
        desired.insert("ns/new".into());
        let decisions = plan(&desired, &owners, &live);
        assert_eq!(
            decisions,
            vec![Decision::Place {
                route: "ns/new".into(),
                to: member("b")
            }]
        );
        apply(&mut owners, &decisions);
        assert!(
            plan(&desired, &owners, &live).is_empty(),
            "a converged pool plans nothing"
        );
    }

    #[test]
    fn a_gone_owner_moves_its_instances_at_term_plus_one() {
        let mut owners: BTreeMap<String, Owner> = BTreeMap::new();
        owners.insert("ns/a1".into(), owner("a", 4));
        owners.insert("ns/a2".into(), owner("a", 1));
        owners.insert("ns/b1".into(), owner("b", 2));
        let desired: BTreeSet<String> = owners.keys().cloned().collect();
        let live = [member("b"), member("c")];
        let decisions = plan(&desired, &owners, &live);
        assert_eq!(
            decisions,
            vec![
                Decision::Recover {
                    route: "ns/a1".into(),
                    from: owner("a", 4),
                    to: member("c"),
                    term: OwnershipTerm::new(5)
                },
                Decision::Recover {
                    route: "ns/a2".into(),
                    from: owner("a", 1),
                    to: member("b"),
                    term: OwnershipTerm::new(2)
                },
            ],
            "least loaded first: c had none, then b and c tie at one and b wins by name"
        );
    }

    #[test]
    fn a_restarted_member_process_owns_nothing() {
        let mut owners = BTreeMap::new();
        owners.insert("ns/x".into(), owner("a", 7));
        let restarted = Candidate {
            process_id: "a-p2".into(),
            ..member("a")
        };
        let decisions = plan(&["ns/x".to_owned()].into(), &owners, std::slice::from_ref(&restarted));
        assert_eq!(
            decisions,
            vec![Decision::Recover {
                route: "ns/x".into(),
                from: owner("a", 7),
                to: restarted,
                term: OwnershipTerm::new(8)
            }]
        );
    }

    #[test]
    fn a_gone_owners_member_is_passed_over_while_others_can_take_it() {
        // a's process died and a new one attached (perhaps to die again): the least loaded,
        // but its instances go to another member, once, and stay there.
        let mut owners = BTreeMap::new();
        owners.insert("ns/x".into(), owner("a", 2));
        owners.insert("ns/y".into(), owner("b", 1));
        let desired: BTreeSet<String> = owners.keys().cloned().collect();
        let restarted = Candidate {
            process_id: "a-p2".into(),
            ..member("a")
        };
        let live = [restarted.clone(), member("b")];
        let decisions = plan(&desired, &owners, &live);
        assert_eq!(
            decisions,
            vec![Decision::Recover {
                route: "ns/x".into(),
                from: owner("a", 2),
                to: member("b"),
                term: OwnershipTerm::new(3)
            }]
        );
        apply(&mut owners, &decisions);
        assert!(plan(&desired, &owners, &live).is_empty(), "one decision, one term");
        // New instances still go to the restarted process (least loaded).
        let mut more = desired.clone();
        more.insert("ns/z".into());
        assert_eq!(
            plan(&more, &owners, &live),
            vec![Decision::Place {
                route: "ns/z".into(),
                to: restarted
            }]
        );
    }

    #[test]
    fn capacity_is_respected_and_refusals_say_why() {
        let small = Candidate {
            capacity: 2,
            ..member("a")
        };
        let decisions = plan(&routes(3), &BTreeMap::new(), &[small]);
        assert!(
            matches!(&decisions[2], Decision::Unplaced { reason, .. } if reason.contains("at capacity") && reason.contains("a holds 2"))
        );
        assert_eq!(
            decisions.iter().filter(|d| matches!(d, Decision::Place { .. })).count(),
            2
        );

        let huge = Candidate {
            capacity: 10_000,
            ..member("a")
        };
        let decisions = plan(&routes(MAX_INSTANCES_PER_MEMBER + 1), &BTreeMap::new(), &[huge]);
        assert!(
            matches!(decisions.last(), Some(Decision::Unplaced { .. })),
            "256 per member at most"
        );

        let none = plan(&routes(1), &BTreeMap::new(), &[]);
        assert!(matches!(&none[0], Decision::Unplaced { reason, .. } if reason == "no live pool members"));

        let leaving = Candidate {
            excluded: true,
            ..member("a")
        };
        let decisions = plan(&routes(1), &BTreeMap::new(), &[leaving]);
        assert!(matches!(&decisions[0], Decision::Unplaced { reason, .. } if reason.contains("leaving or drained")));
    }

    #[test]
    fn excluded_members_keep_what_they_have_but_take_nothing_new() {
        let mut owners = BTreeMap::new();
        owners.insert("ns/kept".into(), owner("a", 1));
        let mut desired: BTreeSet<String> = owners.keys().cloned().collect();
        desired.insert("ns/new".into());
        let live = [
            Candidate {
                excluded: true,
                ..member("a")
            },
            member("b"),
        ];
        assert_eq!(
            plan(&desired, &owners, &live),
            vec![Decision::Place {
                route: "ns/new".into(),
                to: member("b")
            }]
        );
    }

    #[test]
    fn withdrawn_instances_of_gone_owners_are_dropped() {
        let mut owners = BTreeMap::new();
        owners.insert("ns/deleted-gone".into(), owner("a", 3));
        owners.insert("ns/deleted-live".into(), owner("b", 2));
        let decisions = plan(&BTreeSet::new(), &owners, &[member("b")]);
        // Both are dropped at once: a live owner does not keep a withdrawn
        // instance (it releases the session when the route leaves its snapshot).
        assert_eq!(
            decisions,
            vec![
                Decision::Withdraw {
                    route: "ns/deleted-gone".into(),
                    term: OwnershipTerm::new(3)
                },
                Decision::Withdraw {
                    route: "ns/deleted-live".into(),
                    term: OwnershipTerm::new(2)
                }
            ]
        );
        // And a withdrawn instance never holds its owner's capacity.
        let full = Candidate {
            capacity: 1,
            ..member("b")
        };
        let desired = BTreeSet::from(["ns/new".to_owned()]);
        let decisions = plan(&desired, &owners, std::slice::from_ref(&full));
        assert!(
            decisions.contains(&Decision::Place {
                route: "ns/new".into(),
                to: full
            }),
            "{decisions:?}"
        );
    }

    #[test]
    fn a_failed_candidate_is_replaced_at_the_next_term_by_another_member() {
        let mut owners = BTreeMap::new();
        owners.insert(
            "ns/x".into(),
            Owner {
                failed: true,
                stale: false,
                ..owner("a", 2)
            },
        );
        let desired: BTreeSet<String> = owners.keys().cloned().collect();
        let decisions = plan(&desired, &owners, &[member("a"), member("b")]);
        assert_eq!(
            decisions,
            vec![Decision::Recover {
                route: "ns/x".into(),
                from: Owner {
                    failed: true,
                    stale: false,
                    ..owner("a", 2)
                },
                to: member("b"),
                term: OwnershipTerm::new(3)
            }]
        );
        // Alone, the failed member gets another try at a new term.
        let decisions = plan(&desired, &owners, &[member("a")]);
        assert!(
            matches!(&decisions[0], Decision::Recover { to, term, .. } if to.member == "a" && *term == OwnershipTerm::new(3))
        );
        // The others full: the failed member gets it again rather than nobody.
        let full = Candidate {
            capacity: 1,
            ..member("b")
        };
        owners.insert("ns/y".into(), owner("b", 1));
        let desired: BTreeSet<String> = owners.keys().cloned().collect();
        let decisions = plan(&desired, &owners, &[member("a"), full]);
        assert!(
            matches!(&decisions[..], [Decision::Recover { to, term, .. }] if to.member == "a" && *term == OwnershipTerm::new(3)),
            "{decisions:?}"
        );
    }

    #[test]
    fn a_route_taken_over_by_another_workload_is_placed_anew_at_the_next_term() {
        // a holds ns/x for an older workload (stale) and ns/y; b holds nothing.
        let mut owners = BTreeMap::new();
        let stale = Owner {
            stale: true,
            ..owner("a", 4)
        };
        owners.insert("ns/x".into(), stale.clone());
        owners.insert("ns/y".into(), owner("a", 1));
        let desired: BTreeSet<String> = owners.keys().cloned().collect();
        let decisions = plan(&desired, &owners, &[member("a"), member("b")]);
        assert_eq!(
            decisions,
            vec![Decision::Replace {
                route: "ns/x".into(),
                from: stale,
                to: member("b"),
                term: OwnershipTerm::new(5)
            }],
            "least loaded, the stale assignment counting for nothing, and never an old term again"
        );
        // The stale assignment does not hold a's capacity either.
        let full = Candidate {
            capacity: 1,
            ..member("a")
        };
        let only_x: BTreeMap<String, Owner> = owners.into_iter().filter(|(r, _)| r == "ns/x").collect();
        let decisions = plan(&["ns/x".to_owned()].into(), &only_x, &[full]);
        assert!(
            matches!(&decisions[0], Decision::Replace { to, term, .. } if to.member == "a" && *term == OwnershipTerm::new(5))
        );
    }
}
