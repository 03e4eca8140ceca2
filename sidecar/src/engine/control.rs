//! The machine's answers to member messages: redirects, Attached, grants and activation
//! confirmations (committed before they are acknowledged), Relinquish and Release.

use std::time::Duration;

use proto::runtime::v1::{
    ActivationConfirm, Attached, GrantPresentation, PolicyInstall, PolicyLoaded, Redirect, Release, Relinquish,
    SupervisorMessage, sidecar_message, supervisor_message,
};
use proto::timing::reconnect_backoff;
use proto::trust;
use tracing::{debug, error, info, warn};

use super::effect::{Effect, Ending, Keys, Reply};
use super::machine::{LOST, MAX_REASON_BYTES, Machine, Mode, Pending, bounded};
use crate::config::valid_address;
use crate::egress::Policy;
use crate::fence::{Accepted, Fence, Presenter, Refusal, Role, Subject, Verifier};
use crate::receipt::ReceiptKey;
use crate::runtime_link::StreamId;

impl<R: Reply> Machine<R> {
    pub(super) fn on_message(&mut self, id: StreamId, message: SupervisorMessage, keys: Option<Keys>) {
        use supervisor_message::Kind;
        if !self.streams.contains_key(&id) {
            return; // a closed or fenced stream: ignored forever
        }
        let Some(kind) = message.kind else { return };
        if matches!(self.mode, Mode::Stopping) {
            return; // stop won: nothing else is accepted
        }
        match kind {
            Kind::Redirect(redirect) => self.on_redirect(id, redirect),
            Kind::Attached(attached) => self.on_attached(id, &attached),
            Kind::GrantPresentation(grant) => self.on_grant(id, grant, keys),
            Kind::ActivationConfirm(confirm) => self.on_confirm(id, confirm, keys),
            Kind::WorkloadResponse(response) => self.on_response(id, response),
            Kind::Relinquish(relinquish) => self.on_relinquish(id, &relinquish),
            Kind::Release(release) => self.on_release(id, &release),
            Kind::PolicyInstall(install) => self.on_policy(id, &install),
            Kind::AuditAck(ack) => self.on_audit_ack(id, &ack),
            Kind::StoreBehind(behind) => self.on_store_behind(id, behind.term),
            Kind::Heartbeat(_) => {}
        }
    }

    /// The owner saw the store name the route below the activated term, or not at all while
    /// keeping it: the standing goes to
    /// the registry now, so that no term at or below the fence is reserved again.
    fn on_store_behind(&mut self, id: StreamId, term: u64) {
        if self.owner != Some(id) || term != self.state.fence.activated || !matches!(self.mode, Mode::Active) {
            debug!(term, "store-behind notice ignored");
            return;
        }
        info!(term, "the pool's store is behind this term: registering the standing");
        self.register_again();
    }

    fn on_redirect(&mut self, id: StreamId, redirect: Redirect) {
        self.close_stream(id);
        let follow = redirect.route == self.setup.route
            && self.state.fence.follows_redirect(redirect.term)
            && valid_address(&redirect.runtime_address);
        if !follow || !matches!(self.mode, Mode::Placing { .. } | Mode::Recovering { .. }) {
            info!(
                term = redirect.term,
                fence = self.state.fence.activated,
                "redirect ignored"
            );
            self.dial.backoff(self.now.at);
            return;
        }
        debug!(to = %redirect.runtime_address, term = redirect.term, member = %redirect.member, "following redirect");
        // Redirect loops are slowed down; a recovery stream also waits for its hello slot.
        let delay = if self.dial.redirects == 0 {
            Duration::ZERO
        } else {
            reconnect_backoff(self.dial.redirects)
        };
        self.dial.redirects = self.dial.redirects.saturating_add(1);
        self.dial.preferred = Some(redirect.runtime_address);
        if let Mode::Recovering { episode } = &self.mode {
            episode.redirected();
        }
        self.dial.next_at = self.now.at + delay;
    }

    fn on_attached(&mut self, id: StreamId, attached: &Attached) {
        let result = if attached.route == self.setup.route {
            self.state.fence.accept_attached(attached)
        } else {
            Err(Refusal::Route)
        };
        match result {
            Ok(()) => {
                info!(term = attached.term, member = %attached.member, "owner attached");
                self.become_active(id);
            }
            Err(refusal) => {
                warn!(term = attached.term, member = %attached.member, %refusal, "Attached refused; closing the stream");
                self.close_stream(id);
            }
        }
    }

    fn on_grant(&mut self, id: StreamId, grant: GrantPresentation, keys: Option<Keys>) {
        let Some(keys) = keys else {
            return self.verify(id, supervisor_message::Kind::GrantPresentation(grant), false);
        };
        let presenter = Presenter {
            member: grant.member.clone(),
            process_id: grant.process_id.clone(),
        };
        let before = self.state.fence.clone();
        let workload = self.identity();
        let result = self.decide(&keys, |fence, verifier, me, key| {
            fence.present_grant(verifier, me, &grant.grant, &presenter, &workload, key)
        });
        match result {
            Ok(Accepted::Fresh(receipt)) => {
                // Persisted before the receipt leaves: `on_committed` goes on.
                self.pending = Some(Pending::Receipt {
                    id,
                    receipt: Box::new(receipt),
                    presenter,
                    before: Box::new(before),
                });
                self.commit();
            }
            Ok(Accepted::Replay(receipt)) => {
                info!(term = receipt.term, member = %presenter.member, "grant re-presented: same receipt");
                self.hand_receipt(id, presenter, receipt);
            }
            Err(refusal) if stale(&refusal, &keys) => {
                self.verify(id, supervisor_message::Kind::GrantPresentation(grant), true);
            }
            Err(refusal) => {
                warn!(member = %presenter.member, %refusal, "grant refused; closing the stream");
                self.close_stream(id);
            }
        }
    }

    fn on_confirm(&mut self, id: StreamId, confirm: ActivationConfirm, keys: Option<Keys>) {
        let Some(keys) = keys else {
            return self.verify(id, supervisor_message::Kind::ActivationConfirm(confirm), false);
        };
        let presenter = self.streams.get(&id).and_then(|s| s.presenter.clone());
        let before = self.state.fence.clone();
        let result = self.decide(&keys, |fence, verifier, me, _| {
            fence.confirm_activation(verifier, me, &confirm, presenter.as_ref())
        });
        match result {
            Ok(term) => {
                self.pending = Some(Pending::Activation {
                    id,
                    term,
                    before: Box::new(before),
                });
                self.commit();
            }
            Err(refusal) if stale(&refusal, &keys) => {
                self.verify(id, supervisor_message::Kind::ActivationConfirm(confirm), true);
            }
            Err(refusal) => {
                warn!(term = confirm.term, %refusal, "activation confirm refused; closing the stream");
                self.close_stream(id);
            }
        }
    }

    /// The outcome of the commit a receipt or an activation waits for. A failed one restores
    /// the fence as it was and closes the stream: nothing was acknowledged.
    pub(super) fn on_committed(&mut self, result: Result<(), String>) {
        let Some(pending) = self.pending.take() else {
            return;
        };
        match (pending, result) {
            (Pending::Receipt { id, before, .. }, Err(err)) => {
                error!(error = %err, "cannot persist the fence: the grant is not receipted");
                self.state.fence = *before;
                self.close_stream(id);
            }
            (Pending::Activation { id, before, .. }, Err(err)) => {
                error!(error = %err, "cannot persist the activation; the stream is closed");
                self.state.fence = *before;
                self.close_stream(id);
            }
            (
                Pending::Receipt {
                    id,
                    receipt,
                    presenter,
                    before,
                },
                Ok(()),
            ) => {
                info!(
                    term = receipt.term,
                    fenced = receipt.fenced_term,
                    member = %presenter.member,
                    "grant receipted: every lower term is fenced"
                );
                // Fence the older owner's channel (and any other stream) at once.
                self.close_all_except(id);
                // The owner's own process presented the higher term on its stream (a move to
                // the same member): the requests in flight on it stay, answered there once it
                // relays at that term (runtime.proto, WorkloadRequest), failed if it closes
                // first. Any other presenter fails them.
                if self.owner == Some(id) {
                    self.owner = None;
                    if before.owner.as_ref() != Some(&presenter) {
                        self.fail_inflight(id, LOST);
                    }
                }
                if matches!(self.mode, Mode::Active) {
                    self.enter_recovery();
                }
                self.hand_receipt(id, presenter, *receipt);
            }
            (Pending::Activation { id, term, .. }, Ok(())) => {
                info!(term, "term activated; relaying resumes");
                self.become_active(id);
            }
        }
    }

    fn hand_receipt(&mut self, id: StreamId, presenter: Presenter, receipt: proto::recovery::v1::Receipt) {
        if let Some(stream) = self.streams.get_mut(&id) {
            stream.presenter = Some(presenter);
        }
        self.send(id, sidecar_message::Kind::Receipt(receipt));
    }

    fn on_relinquish(&mut self, id: StreamId, relinquish: &Relinquish) {
        let role = if self.owner == Some(id) {
            Role::Owner
        } else {
            Role::Other
        };
        match self.state.fence.relinquish(relinquish.term, role) {
            Ok(()) => {
                info!(term = relinquish.term, "owner relinquished; recovering");
                self.persist();
                if role == Role::Owner {
                    self.hold_inflight(id);
                }
                self.close_stream(id); // enters recovery: the owner's stream is gone
            }
            Err(refusal) => debug!(term = relinquish.term, %refusal, "relinquish ignored"),
        }
    }

    fn on_release(&mut self, id: StreamId, release: &Release) {
        let presenter = self.streams.get(&id).and_then(|s| s.presenter.clone());
        let role = match (&presenter, self.owner == Some(id)) {
            (_, true) => Role::Owner,
            (Some(p), false) => Role::Candidate(p),
            (None, false) => Role::Other,
        };
        if !self.state.fence.accepts_release(release.term, role) {
            warn!(
                term = release.term,
                "release ignored: not from the activated owner or the receipted candidate"
            );
            return;
        }
        info!(term = release.term, reason = %bounded(&release.reason, MAX_REASON_BYTES), "released: stopping the workload");
        self.release_stream = Some(id);
        self.begin_stop(Ending::Released {
            reason: bounded(&release.reason, MAX_REASON_BYTES),
        });
    }

    /// A policy revision from the activated owner at its term is loaded (persisted, then
    /// enforced) unless it is invalid or not newer than the one in force; the revision in force
    /// again takes the install's credential values (never persisted); any other stream's
    /// install changes nothing. Every install is answered with the revision in force.
    fn on_policy(&mut self, id: StreamId, install: &PolicyInstall) {
        let activated = self.state.fence.activated;
        let error = if self.owner != Some(id) || install.term != activated {
            warn!(
                term = install.term,
                activated, "policy install refused: not from the activated owner"
            );
            format!("refused: not from the activated owner at term {activated}")
        } else {
            match install.policy.as_ref().map(Policy::try_from) {
                None => "the install carries no policy".to_owned(),
                Some(Err(invalid)) => {
                    warn!(error = %invalid, "policy install refused");
                    invalid.to_string()
                }
                Some(Ok(policy)) => {
                    let current = self.state.policy.as_ref();
                    if !current.is_some_and(|c| c.name == policy.name && c.revision >= policy.revision) {
                        info!(policy = %policy.name, revision = policy.revision, term = activated, "egress policy installed");
                        self.state.policy = Some(policy.clone());
                        self.persist();
                        self.out.push(Effect::Enforce(std::sync::Arc::new(policy)));
                    } else if current.is_some_and(|c| c.same_revision(&policy) && c.credentials != policy.credentials) {
                        // The same revision with other credential values (a rotated Secret, or
                        // the values again after a restart): only the values change.
                        let held = policy.credentials.iter().filter(|c| c.value.is_some()).count();
                        info!(policy = %policy.name, revision = policy.revision, held, term = activated, "egress credentials installed");
                        self.state.policy = Some(policy.clone());
                        self.out.push(Effect::Enforce(std::sync::Arc::new(policy)));
                    }
                    String::new()
                }
            }
        };
        let (name, revision) = self
            .state
            .policy
            .as_ref()
            .map_or((String::new(), 0), |p| (p.name.clone(), p.revision));
        let loaded = PolicyLoaded {
            term: install.term,
            name,
            revision,
            error: bounded(&error, MAX_REASON_BYTES),
        };
        self.send(id, sidecar_message::Kind::PolicyLoaded(loaded));
    }

    /// Runs a fence decision against `keys`.
    fn decide<T>(
        &mut self,
        keys: &Keys,
        decision: impl FnOnce(&mut Fence, &Verifier<'_>, &Subject<'_>, &ReceiptKey) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let bundle = keys.bundle.as_ref().map_err(|e| Refusal::Trust(e.clone()))?;
        let verifier = Verifier {
            bundle,
            issuer: &self.setup.issuer,
            now_ms: self.now.unix_ms,
        };
        let me = Subject {
            route: &self.setup.route,
            instance: &self.instance,
        };
        decision(&mut self.state.fence, &verifier, &me, &self.state.receipt_key)
    }

    /// Asks the driver for the trust bundle (read again when `reload`) to decide `kind` with.
    fn verify(&mut self, id: StreamId, kind: supervisor_message::Kind, reload: bool) {
        self.out.push(Effect::Verify {
            id,
            message: SupervisorMessage { kind: Some(kind) },
            reload,
        });
    }

    /// Persists the state; the outcome comes back as `Event::Committed`.
    fn commit(&mut self) {
        self.out.push(Effect::Commit(Box::new(self.state.clone())));
    }
}

/// An unknown `kid` with a bundle that was not read again on purpose: read it once more.
fn stale(refusal: &Refusal, keys: &Keys) -> bool {
    matches!(refusal, Refusal::Token(trust::Error::UnknownKid(_))) && !keys.fresh
}
