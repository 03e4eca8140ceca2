//! The member's side of a session's inbox: events the bounded inbox could not take yet wait
//! here, in order, coalesced so the backlog stays short. An assignment of a higher term
//! supersedes every waiting assignment of a lower one (the session would start that term
//! over anyway; the launch material they brought carries over), so the backlog holds at most
//! the current term's few updates (ACTIVE, material, grant), one store-behind notice and the
//! final Stop or Relinquish.

use std::collections::VecDeque;

use tokio::sync::mpsc::{self, error::TrySendError};

use super::SessionEvent;

#[derive(Debug, Default)]
pub(super) struct Backlog(VecDeque<SessionEvent>);

impl Backlog {
    /// Adds an event after the ones waiting.
    pub(super) fn push(&mut self, event: SessionEvent) {
        if matches!(event, SessionEvent::StoreBehind(_))
            && self.0.iter().any(|e| matches!(e, SessionEvent::StoreBehind(_)))
        {
            return; // one notice waiting is enough
        }
        let SessionEvent::Ownership(mut assignment) = event else {
            return self.0.push_back(event);
        };
        let mut material = None;
        self.0.retain_mut(|waiting| match waiting {
            SessionEvent::Ownership(older) if older.term < assignment.term => {
                material = older.credentials.take().or(material.take());
                false
            }
            _ => true,
        });
        assignment.credentials = assignment.credentials.or(material);
        self.0.push_back(SessionEvent::Ownership(assignment));
    }

    /// Hands the waiting events to the inbox, in order, until it is full (a closed inbox:
    /// the session ended and takes nothing more).
    pub(super) fn deliver(&mut self, inbox: &mpsc::Sender<SessionEvent>) {
        while let Some(event) = self.0.pop_front() {
            match inbox.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    tracing::warn!(waiting = self.0.len() + 1, "the session's inbox is full; events wait");
                    return self.0.push_front(event);
                }
                Err(TrySendError::Closed(_)) => return self.0.clear(),
            }
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::plan::{Assignment, TermPhase};
    use crate::sessions::session::tests::material;

    fn ownership(term: u64, phase: TermPhase, with_material: bool) -> SessionEvent {
        SessionEvent::Ownership(Assignment {
            term,
            phase,
            credentials: if with_material { material() } else { None },
            grant: None,
        })
    }

    fn terms(events: &[SessionEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                SessionEvent::Ownership(a) => format!("{} {:?} {}", a.term, a.phase, a.credentials.is_some()),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn drain(inbox: &mut mpsc::Receiver<SessionEvent>) -> Vec<SessionEvent> {
        std::iter::from_fn(|| inbox.try_recv().ok()).collect()
    }

    #[test]
    fn a_full_inbox_keeps_events_in_order_until_it_takes_them() {
        let (events, mut inbox) = mpsc::channel(1);
        let mut backlog = Backlog::default();
        backlog.push(ownership(3, TermPhase::Reserved, true));
        backlog.deliver(&events);
        backlog.push(ownership(3, TermPhase::Active, false));
        backlog.push(SessionEvent::Stop);
        backlog.deliver(&events);
        assert_eq!(backlog.len(), 2, "the inbox holds one");
        assert_eq!(terms(&drain(&mut inbox)), ["3 Reserved true"]);
        backlog.deliver(&events);
        assert_eq!(terms(&drain(&mut inbox)), ["3 Active false"]);
        backlog.deliver(&events);
        assert_eq!(terms(&drain(&mut inbox)), ["Stop"]);
        assert_eq!(backlog.len(), 0);
    }

    #[test]
    fn a_higher_term_supersedes_waiting_assignments_and_keeps_their_material() {
        let (events, mut inbox) = mpsc::channel(1);
        let mut backlog = Backlog::default();
        backlog.push(ownership(1, TermPhase::Reserved, false));
        backlog.deliver(&events);
        for term in 2..100 {
            backlog.push(ownership(term, TermPhase::Reserved, term == 50));
            backlog.push(ownership(term, TermPhase::Active, false));
        }
        backlog.deliver(&events);
        assert_eq!(backlog.len(), 2, "only the latest term's updates wait");
        backlog.push(SessionEvent::Relinquish);
        let mut delivered = drain(&mut inbox);
        for _ in 0..3 {
            backlog.deliver(&events);
            delivered.extend(drain(&mut inbox));
        }
        assert_eq!(
            terms(&delivered),
            ["1 Reserved false", "99 Reserved true", "99 Active false", "Relinquish"]
        );
    }

    #[test]
    fn an_ended_session_drops_what_waits() {
        let (events, inbox) = mpsc::channel(1);
        let mut backlog = Backlog::default();
        backlog.push(SessionEvent::Stop);
        backlog.push(ownership(2, TermPhase::Reserved, false));
        drop(inbox);
        backlog.deliver(&events);
        assert_eq!(backlog.len(), 0);
    }
}
