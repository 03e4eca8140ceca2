//! The terms this member process released. A released term is over for this process: its
//! sidecar was told so (runtime.v1.Relinquish) and takes only a higher term from then on. A
//! store that rolled back (lost commits, an older backup) can list the same term for this
//! process again; the session it starts reports the term FAILED at once, so the coordinator
//! reserves the route above it — instead of an owner that waits for a sidecar that will never
//! take the term again (issue 25: an instance left unanswered after lost commits).
//!
//! Bounded: past [`REMEMBERED`] routes the oldest release is forgotten; a session of such a
//! term then fails when the sidecar tells it the term was relinquished, later but still.

use std::collections::BTreeMap;

use proto::common::v1::InstanceRef;

/// Routes whose last released term is remembered.
pub const REMEMBERED: usize = 4096;

#[derive(Debug, Default)]
pub struct Released {
    /// Per route: the instance, the highest term released, and when (a release counter).
    terms: BTreeMap<String, (InstanceRef, u64, u64)>,
    releases: u64,
}

impl Released {
    /// `route`'s session of `instance` at `term` was released.
    pub fn record(&mut self, route: &str, instance: &InstanceRef, term: u64) {
        self.releases += 1;
        let term = match self.terms.get(route) {
            Some((same, held, _)) if same == instance => term.max(*held),
            _ => term,
        };
        self.terms
            .insert(route.to_owned(), (instance.clone(), term, self.releases));
        if self.terms.len() > REMEMBERED
            && let Some(oldest) = self
                .terms
                .iter()
                .min_by_key(|(_, (_, _, at))| *at)
                .map(|(r, _)| r.clone())
        {
            self.terms.remove(&oldest);
        }
    }

    /// The highest term of `instance` this process released under `route` (0: none).
    pub fn term(&self, route: &str, instance: &InstanceRef) -> u64 {
        match self.terms.get(route) {
            Some((same, term, _)) if same == instance => *term,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(uid: &str) -> InstanceRef {
        InstanceRef {
            namespace: "ns".into(),
            name: "a".into(),
            uid: uid.into(),
            generation: 1,
        }
    }

    #[test]
    fn a_released_term_is_remembered_for_its_own_instance_only() {
        let mut released = Released::default();
        assert_eq!(released.term("ns/a", &instance("u1")), 0);
        released.record("ns/a", &instance("u1"), 3);
        released.record("ns/a", &instance("u1"), 2);
        assert_eq!(released.term("ns/a", &instance("u1")), 3, "the highest is kept");
        assert_eq!(
            released.term("ns/a", &instance("u2")),
            0,
            "another workload under the route"
        );
        released.record("ns/a", &instance("u2"), 1);
        assert_eq!(released.term("ns/a", &instance("u2")), 1);
        assert_eq!(released.term("ns/a", &instance("u1")), 0);
    }

    #[test]
    fn the_oldest_release_is_forgotten_past_the_bound() {
        let mut released = Released::default();
        for i in 0..=REMEMBERED {
            released.record(&format!("ns/{i}"), &instance("u"), 1);
        }
        assert_eq!(released.terms.len(), REMEMBERED);
        assert_eq!(released.term("ns/0", &instance("u")), 0);
        assert_eq!(released.term(&format!("ns/{REMEMBERED}"), &instance("u")), 1);
    }
}
