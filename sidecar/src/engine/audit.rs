//! Delivering the audit spool (`egress::audit`) through the activated owner: one batch at a
//! time, only while a term is active and its owner's stream relays; the spool drops a batch
//! only when that owner acknowledges it at its term. A batch not acknowledged within
//! [`ACK_TIMEOUT`], or whose owner is gone, is sent again (to the next owner after a handoff):
//! the gateway keeps each sequence once, so nothing is lost and nothing is stored twice.
//!
//! A batch follows the one before it after [`LINGER`] at the soonest, unless a whole batch is
//! waiting: a lone decision goes at once, a burst goes in few batches (each one store
//! transaction at the gateway, one rewrite of the spool), not one round through the pool per
//! connection.

use std::time::{Duration, Instant};

use proto::runtime::v1::{AuditAck, AuditRecord, AuditRecords, sidecar_message};
use tracing::debug;

use super::effect::{Effect, Reply};
use super::machine::{Machine, Mode};
use crate::egress::audit::BATCH;
use crate::runtime_link::StreamId;

/// How long a batch waits for its acknowledgement before it is sent again.
pub(super) const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// The least time between two batches, unless a whole batch is waiting.
pub(super) const LINGER: Duration = Duration::from_millis(200);

/// Where the delivery stands.
#[derive(Debug, Default)]
pub(super) struct Delivery {
    /// The highest sequence the spool holds.
    pub last: u64,
    /// The highest sequence acknowledged.
    pub acked: u64,
    /// A batch was asked of the spool and has not come yet.
    pub fetching: bool,
    /// The batch sent and not acknowledged: on which stream, up to which sequence, when.
    pub in_flight: Option<(StreamId, u64, Instant)>,
    /// When the last batch was sent.
    pub sent_at: Option<Instant>,
}

impl<R: Reply> Machine<R> {
    /// The spool holds records up to `last`.
    pub(super) fn on_audit_pending(&mut self, last: u64) {
        self.audit.last = last;
        self.deliver_audit();
    }

    /// The batch the spool gave: sent to the owner, if one still relays.
    pub(super) fn on_audit_fetched(&mut self, records: Vec<AuditRecord>, dropped: u64) {
        self.audit.fetching = false;
        let (Some(id), Some(through)) = (self.relaying_owner(), records.last().map(|r| r.sequence)) else {
            return;
        };
        if self.audit.in_flight.is_some() {
            return;
        }
        self.audit.in_flight = Some((id, through, self.now.at));
        self.audit.sent_at = Some(self.now.at);
        self.send(
            id,
            sidecar_message::Kind::AuditRecords(AuditRecords { records, dropped }),
        );
    }

    /// The owner's acknowledgement: taken only from the activated owner at its term, and only
    /// up to what was sent on its stream.
    pub(super) fn on_audit_ack(&mut self, id: StreamId, ack: &AuditAck) {
        let from_owner = self.owner == Some(id) && ack.term == self.state.fence.activated;
        let Some((sent_on, through, _)) = self.audit.in_flight else {
            return;
        };
        if !from_owner || sent_on != id || ack.through > through || ack.through <= self.audit.acked {
            debug!(term = ack.term, through = ack.through, "audit acknowledgement ignored");
            return;
        }
        self.audit.acked = ack.through;
        if ack.through == through {
            self.audit.in_flight = None;
        }
        self.out.push(Effect::AckAudit(ack.through));
        self.deliver_audit();
    }

    /// Asks the spool for the next batch when there is one to send and an owner to send it to.
    pub(super) fn deliver_audit(&mut self) {
        if let Some((_, _, sent_at)) = self.audit.in_flight {
            let lost = self
                .audit
                .in_flight
                .is_some_and(|(id, _, _)| self.relaying_owner() != Some(id));
            if !lost && self.now.at < sent_at + ACK_TIMEOUT {
                return;
            }
            self.audit.in_flight = None;
        }
        if self.audit.fetching
            || self.audit.last <= self.audit.acked
            || self.relaying_owner().is_none()
            || self.lingering().is_some()
        {
            return;
        }
        self.audit.fetching = true;
        self.out.push(Effect::FetchAudit {
            after: self.audit.acked,
        });
    }

    /// When a batch in flight is due again, or the next one may go.
    pub(super) fn audit_wake(&self) -> Option<Instant> {
        match self.audit.in_flight {
            Some((_, _, sent_at)) => Some(sent_at + ACK_TIMEOUT),
            None => self.lingering(),
        }
    }

    /// Until when the records waiting (fewer than a batch) wait for more.
    fn lingering(&self) -> Option<Instant> {
        let waiting = self.audit.last.saturating_sub(self.audit.acked);
        let due = self.audit.sent_at? + LINGER;
        (waiting > 0 && waiting < BATCH as u64 && self.now.at < due).then_some(due)
    }

    fn relaying_owner(&self) -> Option<StreamId> {
        self.owner.filter(|_| matches!(self.mode, Mode::Active))
    }
}
