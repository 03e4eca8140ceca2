//! One recovery episode: its deadline and its RecoveryHello budget. Shared between the engine
//! (repeating a hello on an open stream) and the links dialing a new stream (whose first
//! message is a hello), so the rule holds across streams: at most one RecoveryHello per
//! `RECOVERY_HELLO_INTERVAL`, attempts numbered from 1, none at or after the deadline — except
//! that the first hello answered by a redirect may be followed at once by one to the owner it
//! names (a planned move redirects the first hello to the new owner; waiting a whole interval
//! there would be the whole handoff gap). The deadline is fixed when the episode starts:
//! nothing a candidate does extends it.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use proto::common::v1::WorkloadIdentity;
use proto::runtime::v1::RecoveryHello;
use proto::timing::RECOVERY_HELLO_INTERVAL;

#[derive(Debug)]
pub struct Episode {
    deadline: Instant,
    deadline_ms: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    template: RecoveryHello,
    attempts: u32,
    last: Option<Instant>,
    closed: bool,
    /// The one redirect of this episode that skips the interval was used.
    redirected: bool,
}

/// What the budget allows now.
#[derive(Debug, PartialEq)]
pub enum Slot {
    /// Send this hello now (the attempt is counted).
    Ready(RecoveryHello),
    /// Not before this instant.
    Wait(Instant),
    /// The episode ended or its deadline passed: no more hellos.
    Over,
}

impl Episode {
    /// A new episode ending at `deadline`; `deadline_ms` is the recovery deadline it applies.
    /// `template` carries route, instance, fence term, relinquished and workload.
    pub fn new(template: RecoveryHello, deadline: Instant, deadline_ms: u64) -> Self {
        Self {
            deadline,
            deadline_ms,
            inner: Mutex::new(Inner {
                template,
                attempts: 0,
                last: None,
                closed: false,
                redirected: false,
            }),
        }
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    pub fn deadline_ms(&self) -> u64 {
        self.deadline_ms
    }

    pub fn attempts(&self) -> u32 {
        self.lock().attempts
    }

    /// A redirect answered the last hello: the next hello (to the owner it names) may go at
    /// once — the first time in this episode only, so a redirect loop keeps the interval.
    pub fn redirected(&self) {
        let mut inner = self.lock();
        if !inner.redirected {
            inner.redirected = true;
            inner.last = None;
        }
    }

    /// Ends the episode: no further hello, from any stream.
    pub fn close(&self) {
        self.lock().closed = true;
    }

    /// Updates the workload identity the hellos carry.
    pub fn set_workload(&self, workload: WorkloadIdentity) {
        self.lock().template.workload = Some(workload);
    }

    /// When the next hello may be sent (at `now` or later), `None` if never.
    pub fn next_slot(&self, now: Instant) -> Option<Instant> {
        let inner = self.lock();
        let next = inner.last.map_or(now, |last| last + RECOVERY_HELLO_INTERVAL);
        (!inner.closed && next < self.deadline).then_some(next)
    }

    /// Takes the slot at `now` if the budget allows it.
    pub fn take(&self, now: Instant) -> Slot {
        let mut inner = self.lock();
        if inner.closed || now >= self.deadline {
            return Slot::Over;
        }
        if let Some(last) = inner.last {
            let next = last + RECOVERY_HELLO_INTERVAL;
            if now < next {
                return if next < self.deadline {
                    Slot::Wait(next)
                } else {
                    Slot::Over
                };
            }
        }
        inner.attempts += 1;
        inner.last = Some(now);
        let remaining = self
            .deadline
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        Slot::Ready(RecoveryHello {
            attempt: inner.attempts,
            deadline_remaining_ms: u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX),
            ..inner.template.clone()
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn episode(deadline: Duration) -> (Episode, Instant) {
        let start = Instant::now();
        let template = RecoveryHello {
            route: "r".into(),
            fence_term: 3,
            relinquished: true,
            ..RecoveryHello::default()
        };
        (Episode::new(template, start + deadline, 5_000), start)
    }

    #[test]
    fn the_first_redirect_may_be_followed_at_once_later_ones_wait() {
        let (ep, start) = episode(Duration::from_secs(30));
        assert!(matches!(ep.take(start), Slot::Ready(_)));
        let soon = start + Duration::from_millis(1);
        ep.redirected();
        let Slot::Ready(followed) = ep.take(soon) else {
            panic!("the hello to the named owner goes at once")
        };
        assert_eq!(followed.attempt, 2);
        ep.redirected();
        let later = soon + Duration::from_millis(1);
        assert_eq!(
            ep.take(later),
            Slot::Wait(soon + RECOVERY_HELLO_INTERVAL),
            "a second redirect in the episode keeps the interval"
        );
    }

    #[test]
    fn one_hello_per_interval_numbered_until_the_deadline() {
        let (ep, start) = episode(Duration::from_millis(3_500));
        let Slot::Ready(first) = ep.take(start) else { panic!() };
        assert_eq!((first.attempt, first.deadline_remaining_ms), (1, 3_500));
        assert_eq!((first.fence_term, first.relinquished), (3, true));
        let half = start + Duration::from_millis(500);
        assert_eq!(ep.take(half), Slot::Wait(start + RECOVERY_HELLO_INTERVAL));
        let mut sent = vec![first.attempt];
        let mut t = start;
        while t < start + Duration::from_secs(10) {
            t += Duration::from_millis(100);
            if let Slot::Ready(h) = ep.take(t) {
                assert!(h.deadline_remaining_ms > 0);
                sent.push(h.attempt);
            }
        }
        assert_eq!(sent, [1, 2, 3, 4], "at 0, 1, 2 and 3 s; none at or after 3.5 s");
        assert_eq!(ep.attempts(), 4);
        assert_eq!(ep.next_slot(start), None, "the next slot would be past the deadline");
        assert_eq!(ep.take(start + Duration::from_secs(4)), Slot::Over);
    }

    #[test]
    fn a_closed_episode_sends_nothing() {
        let (ep, start) = episode(Duration::from_secs(60));
        ep.close();
        assert_eq!(ep.take(start), Slot::Over);
        assert_eq!(ep.next_slot(start), None);
        assert_eq!(ep.attempts(), 0);
    }
}
