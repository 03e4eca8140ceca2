//! The takeover of a reserved term (runtime.proto steps 1a and 2-3, recovery.proto): the grant
//! (from the snapshot, or recovery.v1.IssueGrant sent once) is presented to the sidecar, its
//! Receipt goes to recovery.v1.Activate (sent once), and the activation proof is confirmed to
//! the sidecar. A lost or failed IssueGrant or Activate is never retried: the instance is
//! reported FAILED for the term and the coordinator reserves a new one.
//!
//! The same state machine answers a sidecar of an already active term (Attached), refuses a
//! fence above the term, re-presents the grant on a new stream of the same sidecar (it answers
//! the same receipt) and, when a stop is pending, releases instead of activating.

use std::time::Duration;

use proto::recovery::v1::{ActivateRequest, ActivationProof, IssueGrantRequest, IssueGrantResponse, Receipt};
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::{ActivationConfirm, Attached, GrantPresentation, PolicyInstall, PolicyLoaded};
use proto::timing;
use tracing::{info, warn};

use super::effect::Effect;
use super::machine::{Call, Machine};
use crate::gateway::CallError;
use crate::sessions::plan::{Assignment, Grant, TermPhase};

/// Where the session is with its current term.
#[derive(Debug)]
pub(super) enum Stage {
    /// The term is reserved for this process; `asked`: IssueGrant was sent for it.
    Reserved { asked: bool },
    /// Activate is in flight.
    Activating,
    /// The term is active: activated by this session (with its proof), or adopted from a
    /// snapshot that listed it ACTIVE (no proof).
    Active { activation: Option<Activation> },
    /// This process cannot run the term; waits for a higher one.
    Failed(String),
}

/// The activation proof (a bearer-like token: redacted `Debug`).
#[derive(Clone)]
pub(super) struct Activation {
    proof: String,
    activated_at_ms: i64,
}

impl std::fmt::Debug for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Activation(<redacted>, activated_at_ms: {})", self.activated_at_ms)
    }
}

/// The next step the state allows.
enum Step {
    Attach,
    Present,
    Issue,
    Fail(String),
    Wait,
}

impl Machine {
    /// Takes every step the current state allows; called after every event.
    pub(super) fn advance(&mut self) {
        if self.ended.is_some() {
            return;
        }
        match self.next_step() {
            Step::Attach => self.attach(),
            Step::Present => self.present(),
            Step::Issue => self.issue(),
            Step::Fail(reason) => self.fail(reason),
            Step::Wait => {}
        }
        self.deliver_release();
    }

    fn next_step(&self) -> Step {
        if matches!(self.stage, Stage::Failed(_) | Stage::Activating) {
            return Step::Wait;
        }
        // A term this process released, listed again (the store rolled back): the sidecar
        // takes only a higher term now, which the coordinator reserves once this is reported.
        if self.term <= self.setup.released {
            return Step::Fail(format!(
                "this member process released term {} of the instance; only a higher term can take it up",
                self.term
            ));
        }
        let Some(sidecar) = &self.sidecar else {
            return Step::Wait;
        };
        let fence = sidecar.opening.fence_term;
        // Its owner relinquished this very term: the sidecar never takes it again.
        if fence == self.term && sidecar.opening.relinquished && !sidecar.attached {
            return Step::Fail(format!(
                "the sidecar's owner relinquished term {fence}; only a higher term can take the instance up"
            ));
        }
        match &self.stage {
            Stage::Failed(_) | Stage::Activating => Step::Wait,
            Stage::Active { .. } if fence == self.term => {
                if sidecar.attached {
                    Step::Wait
                } else {
                    Step::Attach
                }
            }
            Stage::Active { activation: Some(_) } if self.grant.is_some() => {
                // Activated by us, but this stream has not seen the confirm: present the same
                // grant again (same receipt), then confirm with the proof held.
                if sidecar.presented { Step::Wait } else { Step::Present }
            }
            Stage::Active { .. } => Step::Fail(format!(
                "term {} is active but this member process holds no activation proof for it",
                self.term
            )),
            Stage::Reserved { .. } if fence >= self.term => Step::Wait,
            Stage::Reserved { .. } if self.grant.is_some() => {
                if sidecar.presented {
                    Step::Wait
                } else {
                    Step::Present
                }
            }
            Stage::Reserved { asked: false } if self.credentials.is_some() || self.stop.is_some() => Step::Issue,
            Stage::Reserved { .. } => Step::Wait,
        }
    }

    /// Applies a snapshot's assignment: a higher term starts over (the sidecar stream stays),
    /// the same term may bring material, a grant or the ACTIVE phase.
    pub(super) fn on_ownership(&mut self, assignment: Assignment) {
        if let Some(credentials) = assignment.credentials {
            self.credentials = Some(credentials);
        }
        if assignment.term > self.term {
            if self.term != 0 {
                info!(from = self.term, to = assignment.term, "moving to a higher term");
            }
            tracing::Span::current().record("term", assignment.term);
            self.term = assignment.term;
            self.stage = assignment.phase.initial_stage();
            if self.call.take().is_some() {
                self.out.push(Effect::CancelCall);
            }
            self.grant = None;
            self.grant_deadline = None;
            self.counters = Default::default();
            self.lost_at_active = false;
            // The stream held, if any, stays: the sidecar was met at the new term too.
            self.met_this_term = self.sidecar.is_some();
            self.gave_up = false;
            if let Some(sidecar) = &mut self.sidecar {
                sidecar.presented = false;
                sidecar.receipted = false;
                sidecar.relayed_before |= sidecar.attached;
                sidecar.attached = false;
            }
        } else if assignment.term < self.term {
            return;
        }
        if let Stage::Reserved { asked: false } = self.stage
            && self.grant.is_none()
        {
            if assignment.phase == TermPhase::Active {
                // Activated without this process asking: adopt it (an Attach at this term
                // is answered; a lower fence cannot be confirmed and fails).
                self.stage = Stage::Active { activation: None };
            } else if let Some(grant) = assignment.grant {
                self.take_grant(grant);
            }
        }
    }

    fn take_grant(&mut self, grant: Grant) {
        let left_ms = if grant.expires_at_ms == 0 {
            u64::try_from(timing::MAX_GRANT_LIFETIME.as_millis()).unwrap_or(u64::MAX)
        } else {
            u64::try_from(grant.expires_at_ms.saturating_sub(self.now.unix_ms)).unwrap_or(0)
        };
        let left = Duration::from_millis(left_ms).min(timing::MAX_GRANT_LIFETIME + timing::MAX_CLOCK_SKEW);
        self.grant_deadline = Some(self.now.at + left);
        self.grant = Some(grant);
    }

    fn issue(&mut self) {
        self.stage = Stage::Reserved { asked: true };
        let request = IssueGrantRequest {
            route: self.setup.route.clone(),
            term: self.term,
            member: self.setup.me.member.clone(),
            process_id: self.setup.me.process_id.clone(),
        };
        info!("requesting the recovery grant (sent once)");
        self.call = Some(Call::Grant);
        self.out.push(Effect::IssueGrant(request));
    }

    fn present(&mut self) {
        let (Some(sidecar), Some(grant)) = (&mut self.sidecar, &self.grant) else {
            return;
        };
        let presentation = GrantPresentation {
            grant: grant.token.clone(),
            member: self.setup.me.member.clone(),
            process_id: self.setup.me.process_id.clone(),
        };
        info!(stream = sidecar.id, "grant presented");
        sidecar.presented = true;
        self.send(Kind::GrantPresentation(presentation));
    }

    /// Attached at the active term. (A stream that relays makes the phase ACTIVE whatever was
    /// lost before, so `lost_at_active` stays as it is: a stream that cannot take the message
    /// is dropped without having attached.)
    fn attach(&mut self) {
        let Some(sidecar) = &mut self.sidecar else { return };
        let attached = Attached {
            route: self.setup.route.clone(),
            term: self.term,
            member: self.setup.me.member.clone(),
            process_id: self.setup.me.process_id.clone(),
            recovery_deadline_ms: self.now.recovery_deadline_ms,
        };
        info!(stream = sidecar.id, "sidecar attached at the active term");
        sidecar.attached = true;
        if std::mem::take(&mut self.gave_up) {
            info!("the sidecar came back before a higher term: the term is not given up");
        }
        self.send(Kind::Attached(attached));
        self.install_policy();
        self.tell_pending_store_behind();
    }

    /// The sidecar's answer to this session's presentation on the current stream.
    pub(super) fn on_receipt(&mut self, receipt: Receipt) {
        let Some(sidecar) = &mut self.sidecar else { return };
        let grant_id = self.grant.as_ref().and_then(|g| g.id.as_deref());
        let matches = sidecar.presented
            && receipt.route == self.setup.route
            && receipt.term == self.term
            && receipt.instance.as_ref() == Some(&self.setup.instance)
            && grant_id.is_none_or(|id| id == receipt.grant_id);
        if !matches {
            warn!(
                term = receipt.term,
                "ignoring a receipt that does not answer this session's grant"
            );
            return;
        }
        sidecar.receipted = true;
        self.grant_deadline = None;
        self.note_workload(receipt.workload.as_ref().map_or(0, |w| w.pid));
        info!(fenced_term = receipt.fenced_term, "receipt received");
        match &self.stage {
            // Stop wins: the receipt lets the sidecar accept our Release; nothing is activated.
            Stage::Reserved { .. } if self.stop.is_some() => {}
            Stage::Reserved { .. } => self.activate(receipt),
            Stage::Active {
                activation: Some(activation),
            } if self.stop.is_none() => {
                let activation = activation.clone();
                self.confirm(&activation);
            }
            _ => {}
        }
    }

    fn activate(&mut self, receipt: Receipt) {
        let Some(grant) = &self.grant else { return };
        let request = ActivateRequest {
            receipt: Some(receipt),
            grant: grant.token.clone(),
        };
        self.stage = Stage::Activating;
        info!("activating the term (sent once)");
        self.call = Some(Call::Activation);
        self.out.push(Effect::Activate(request));
    }

    /// ActivationConfirm on the stream that receipted (`lost_at_active` as in `attach`).
    fn confirm(&mut self, activation: &Activation) {
        let Some(sidecar) = self.sidecar.as_mut().filter(|s| s.receipted) else {
            return; // A new stream: the grant is presented again first.
        };
        let confirm = ActivationConfirm {
            term: self.term,
            proof: activation.proof.clone(),
            activated_at_ms: activation.activated_at_ms,
            recovery_deadline_ms: self.now.recovery_deadline_ms,
        };
        info!(stream = sidecar.id, "activation confirmed to the sidecar");
        sidecar.attached = true;
        sidecar.opening.fence_term = self.term;
        sidecar.opening.relinquished = false;
        self.send(Kind::ActivationConfirm(confirm));
        self.install_policy();
        self.tell_pending_store_behind();
    }

    /// The egress policy revision, stamped with this session's term, right after the sidecar
    /// accepted the term (it loads installs only from its activated owner at that term).
    fn install_policy(&mut self) {
        let Some(policy) = &self.setup.policy else { return };
        let install = PolicyInstall {
            term: self.term,
            policy: Some(policy.as_ref().clone()),
        };
        self.send(Kind::PolicyInstall(install));
    }

    /// A new revision from the member: installed at once where the sidecar relays for this
    /// session's term (elsewhere with the next attach or activation).
    pub(super) fn on_policy(&mut self, policy: Option<std::sync::Arc<proto::runtime::v1::EgressPolicy>>) {
        self.setup.policy = policy;
        if self.sidecar.as_ref().is_some_and(|s| s.attached) && self.stop.is_none() {
            self.install_policy();
        }
    }

    /// The sidecar's answer to an install (one for another term is not this session's).
    pub(super) fn on_policy_loaded(&mut self, loaded: &PolicyLoaded) {
        if loaded.term != self.term {
            return;
        }
        self.egress_loaded = Some(PolicyLoaded {
            term: loaded.term,
            name: plumbing::text::bounded(&loaded.name, proto::MAX_POLICY_NAME_BYTES),
            revision: loaded.revision,
            error: plumbing::text::bounded(&loaded.error, 256),
        });
        if loaded.error.is_empty() {
            info!(policy = %loaded.name, revision = loaded.revision, "egress policy loaded by the sidecar");
        } else {
            warn!(
                policy = %loaded.name,
                revision = loaded.revision,
                error = %plumbing::text::bounded(&loaded.error, 256),
                "the sidecar did not load the egress policy"
            );
        }
    }

    /// Whether `call` is the one in flight; it then is no longer.
    fn finished(&mut self, call: Call) -> bool {
        let awaited = self.call == Some(call);
        if awaited {
            self.call = None;
        }
        awaited
    }

    /// The outcome of IssueGrant (one that is no longer awaited is ignored).
    pub(super) fn on_granted(&mut self, outcome: Result<IssueGrantResponse, CallError>) {
        if !self.finished(Call::Grant) {
            return;
        }
        match outcome {
            Ok(response) => {
                if response.instance.as_ref().is_some_and(|i| *i != self.setup.instance) {
                    return self.fail(format!("IssueGrant for term {} named another instance", self.term));
                }
                info!(grant_id = %response.grant_id, "grant issued");
                self.take_grant(Grant {
                    token: response.grant,
                    id: Some(response.grant_id),
                    expires_at_ms: response.expires_at_ms,
                });
            }
            Err(err) => {
                self.fail(format!("IssueGrant for term {} failed (not retried): {err}", self.term));
            }
        }
    }

    /// The outcome of Activate (one that is no longer awaited is ignored).
    pub(super) fn on_activated(&mut self, outcome: Result<ActivationProof, CallError>) {
        if !self.finished(Call::Activation) {
            return;
        }
        match outcome {
            Ok(proof) => {
                if proof.term != self.term || proof.route != self.setup.route {
                    return self.fail(format!(
                        "Activate for term {} answered another term or route",
                        self.term
                    ));
                }
                info!(activated_at_ms = proof.activated_at_ms, "term activated");
                self.store_caught_up();
                let activation = Activation {
                    proof: proof.proof,
                    activated_at_ms: proof.activated_at_ms,
                };
                self.stage = Stage::Active {
                    activation: Some(activation.clone()),
                };
                if self.stop.is_none() {
                    self.confirm(&activation);
                }
            }
            Err(err) => {
                self.fail(format!("Activate for term {} failed (not retried): {err}", self.term));
            }
        }
    }

    /// The STARTING message: what the takeover waits for.
    pub(super) fn starting_detail(&self) -> &'static str {
        let presented = self.sidecar.as_ref().is_some_and(|s| s.presented);
        match (&self.stage, &self.sidecar) {
            (Stage::Activating, _) => "activating the term",
            (_, _) if self.credentials.is_none() && self.stop.is_none() => "waiting for launch material",
            (_, None) => "waiting for the sidecar to connect",
            _ if self.call.is_some() => "requesting the recovery grant",
            _ if presented => "grant presented; waiting for the sidecar's receipt",
            _ => "waiting for the sidecar to leave its current term",
        }
    }
}

impl TermPhase {
    fn initial_stage(self) -> Stage {
        match self {
            TermPhase::Reserved => Stage::Reserved { asked: false },
            TermPhase::Active => Stage::Active { activation: None },
        }
    }
}
