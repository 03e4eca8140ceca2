//! The lease decisions both backends make once they hold the lease row lock
//! and have sampled the database clock. Pure, so they are tested without I/O.

use super::{Acquire, CoordinatorTerm, Error, Fence, FencedWrite, Lease, LeaseView, OwnershipTerm};

/// Acquire: an expired (or never held) lease is taken with the term bumped by
/// one; a live lease of the same holder is extended in place; a live lease of
/// another holder is reported.
pub(crate) fn acquire(row: &LeaseView, holder: &str, length_ms: i64) -> Acquire {
    let expires_at_ms = row.now_ms.saturating_add(length_ms);
    if row.is_live() && row.holder != holder {
        return Acquire::HeldBy(row.clone());
    }
    let term = if row.is_live() { row.term } else { row.term.next() };
    Acquire::Acquired(Lease {
        holder: holder.to_owned(),
        term,
        expires_at_ms,
    })
}

/// Check a caller's lease against the locked row, at the row's database time.
pub(crate) fn fence(row: &LeaseView, lease: &Lease) -> Result<(), Fence> {
    if row.term == CoordinatorTerm::ZERO {
        return Err(Fence::NoLease);
    }
    if row.term != lease.term || row.holder != lease.holder {
        return Err(Fence::Superseded {
            term: lease.term,
            current_term: row.term,
        });
    }
    if !row.is_live() {
        return Err(Fence::Expired {
            term: lease.term,
            expires_at_ms: row.expires_at_ms,
            now_ms: row.now_ms,
        });
    }
    Ok(())
}

/// Validate a batch before any I/O: terms must grow, bounds must hold.
pub(crate) fn validate(writes: &[FencedWrite]) -> Result<(), Error> {
    for write in writes {
        match write {
            FencedWrite::Assign { expected_term, next }
                if next.term == OwnershipTerm::ZERO || expected_term.is_some_and(|t| next.term <= t) =>
            {
                return Err(Error::Invalid(format!(
                    "assignment of {} must move to a term above {:?}, got {}",
                    next.route, expected_term, next.term
                )));
            }
            FencedWrite::PutOperation(op) if !(1..=8).contains(&op.max_parallel) => {
                return Err(Error::Invalid(format!(
                    "operation {} max_parallel {} is outside 1..=8",
                    op.id, op.max_parallel
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(holder: &str, term: u64, expires_at_ms: i64, now_ms: i64) -> LeaseView {
        LeaseView {
            holder: holder.into(),
            term: CoordinatorTerm::new(term),
            expires_at_ms,
            now_ms,
        }
    }

    fn acquired(a: Acquire) -> Lease {
        match a {
            Acquire::Acquired(lease) => lease,
            Acquire::HeldBy(row) => panic!("expected the lease, held by {row:?}"),
        }
    }

    #[test]
    fn first_lease_is_term_one() {
        let lease = acquired(acquire(&row("", 0, 0, 1000), "a", 5000));
        assert_eq!((lease.term.get(), lease.expires_at_ms), (1, 6000));
    }

    #[test]
    fn term_bumps_only_when_expired() {
        assert!(
            matches!(acquire(&row("a", 4, 2000, 1999), "b", 10), Acquire::HeldBy(r) if r.term == CoordinatorTerm::new(4))
        );
        let same = acquired(acquire(&row("a", 4, 2000, 1999), "a", 10));
        assert_eq!((same.term.get(), same.expires_at_ms), (4, 2009));
        let next = acquired(acquire(&row("a", 4, 2000, 2000), "b", 10));
        assert_eq!((next.term.get(), next.holder.as_str()), (5, "b"));
        let again = acquired(acquire(&row("a", 4, 2000, 2000), "a", 10));
        assert_eq!(
            again.term,
            CoordinatorTerm::new(5),
            "re-acquiring after expiry is a new term"
        );
    }

    #[test]
    fn fence_checks_holder_term_and_expiry() {
        let lease = Lease {
            holder: "a".into(),
            term: CoordinatorTerm::new(3),
            expires_at_ms: 100,
        };
        assert_eq!(fence(&row("", 0, 0, 0), &lease), Err(Fence::NoLease));
        assert!(fence(&row("a", 3, 100, 99), &lease).is_ok());
        assert!(matches!(
            fence(&row("a", 3, 100, 100), &lease),
            Err(Fence::Expired { .. })
        ));
        assert!(matches!(
            fence(&row("b", 4, 500, 10), &lease),
            Err(Fence::Superseded { current_term, .. }) if current_term == CoordinatorTerm::new(4)
        ));
        assert!(matches!(
            fence(&row("b", 3, 500, 10), &lease),
            Err(Fence::Superseded { .. })
        ));
    }
}
