//! The member's side of a session's inbox: events the bounded inbox could not take yet wait
//! here, in order, coalesced so the backlog stays short. An assignment of a higher term
//! supersedes every waiting assignment of a lower one (the session would start that term
//! over anyway; the launch material they brought carries over), so the backlog holds at most
//! the current term's few updates (ACTIVE, material, grant) and the final Stop or Relinquish.

use std::collections::VecDeque;

use tokio::sync::mpsc::{self, error::TrySendError};

use super::SessionEvent;

#[derive(Debug, Default)]
pub(super) struct Backlog(VecDeque<SessionEvent>);

impl Backlog {
    /// Adds an event after the ones waiting.
    pub(super) fn push(&mut self, event: SessionEvent) {
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
