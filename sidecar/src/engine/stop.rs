//! How the machine stops: a missed deadline, a release, the workload's exit or a shutdown
//! freeze everything (held and relayed requests refused), stop the workload when it is the
//! machine's to stop, and end in `Effect::Done`; then `conclude` says what the registry hears.

use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest};
use proto::runtime::v1::sidecar_message;
use tracing::{error, info};

use super::effect::{Effect, Ending, Reply};
use super::machine::{MAX_REASON_BYTES, Machine, Mode, STOPPING, bounded};
use crate::Outcome;
use crate::process::Exit;
use crate::state_file::State;

/// Longest RecoveryFailedRequest.reason.
const MAX_FAILURE_REASON_BYTES: usize = 512;

/// What the registry is told once the machine is done.
#[derive(Debug)]
pub(crate) enum Report {
    Deregister(DeregisterRequest),
    RecoveryFailed(RecoveryFailedRequest),
}

/// How the instance ended: the state to persist (marked ended), then the report.
#[derive(Debug)]
pub(crate) struct Conclusion {
    pub outcome: Outcome,
    pub state: Box<State>,
    pub report: Report,
}

impl<R: Reply> Machine<R> {
    /// After `Done`: the state marked ended and what the registry is told (nothing after a
    /// shutdown: the instance stays registered).
    pub(crate) fn conclude(&mut self, ending: Ending, exit: Option<Exit>) -> Option<Conclusion> {
        let exit_text = exit.map_or_else(|| "the workload was not running".to_owned(), |e| e.to_string());
        let (outcome, reason) = match &ending {
            Ending::Shutdown => return None,
            Ending::Released { reason } => (Outcome::Released, format!("released: {reason}")),
            Ending::Exited => (Outcome::Exited, format!("workload {exit_text}")),
            Ending::RecoveryFailed { request } => (Outcome::RecoveryFailed, request.reason.clone()),
        };
        self.state.ended = Some(reason.clone());
        let report = match ending {
            Ending::RecoveryFailed { request } => Report::RecoveryFailed(request),
            _ => Report::Deregister(DeregisterRequest {
                route: self.setup.route.clone(),
                instance: Some(self.instance.clone()),
                reason: bounded(&reason, MAX_REASON_BYTES),
            }),
        };
        Some(Conclusion {
            outcome,
            state: Box::new(self.state.clone()),
            report,
        })
    }

    pub(super) fn on_exit(&mut self, exit: Exit) {
        info!(%exit, "the workload process ended");
        let ending = match self.ending.clone() {
            Some(ending) => ending,
            None => {
                self.freeze_for_stop(Ending::Exited);
                Ending::Exited
            }
        };
        let reason = match &ending {
            Ending::Released { reason } => format!("released: {reason}"),
            Ending::Exited => exit.to_string(),
            Ending::RecoveryFailed { .. } => "recovery deadline exceeded".into(),
            Ending::Shutdown => "the sidecar is shutting down".into(),
        };
        let stopped = proto::runtime::v1::Stopped {
            reason: bounded(&reason, MAX_REASON_BYTES),
            exit_code: exit.code,
            signal: exit.signal,
        };
        if let Some(id) = self.release_stream.or(self.owner) {
            self.send(id, sidecar_message::Kind::Stopped(stopped));
        }
        self.workload = None;
        self.out.push(Effect::Done {
            ending,
            exit: Some(exit),
        });
    }

    pub(super) fn recovery_failed(&mut self, reason: &str) {
        let (attempts, deadline_ms) = match &self.mode {
            Mode::Recovering { episode } => (episode.attempts(), episode.deadline_ms()),
            Mode::Placing { deadline_ms, .. } => (0, *deadline_ms),
            _ => (0, 0),
        };
        // Without an identified workload process there is nothing to stop: say so, in the
        // log and in the reason the registry records.
        let reason = if self.workload.is_some() {
            error!(
                attempts,
                deadline_ms,
                fence = self.state.fence.activated,
                "{reason}: stopping the workload (SupervisorRecoveryFailed)"
            );
            reason.to_owned()
        } else {
            error!(
                attempts,
                deadline_ms,
                fence = self.state.fence.activated,
                "{reason}: no workload process was identified, so nothing is stopped; the next generation is registered (SupervisorRecoveryFailed)"
            );
            format!("{reason}; no workload process was identified, nothing was stopped")
        };
        let request = RecoveryFailedRequest {
            route: self.setup.route.clone(),
            instance: Some(self.instance.clone()),
            fence_term: self.state.fence.activated,
            receipted_term: self.state.fence.pending_term(),
            attempts,
            recovery_deadline_ms: deadline_ms,
            reason: bounded(&reason, MAX_FAILURE_REASON_BYTES),
        };
        self.begin_stop(Ending::RecoveryFailed { request });
    }

    /// Stop wins: freeze everything, then stop the workload (for a shutdown only when it is
    /// the sidecar's own child).
    pub(super) fn begin_stop(&mut self, ending: Ending) {
        if self.ending.is_some() {
            return;
        }
        let stop_workload = !matches!(ending, Ending::Shutdown) || self.setup.local;
        self.freeze_for_stop(ending.clone());
        if self.workload.is_some() && stop_workload {
            self.out.push(Effect::StopWorkload);
        } else {
            self.out.push(Effect::Done { ending, exit: None });
        }
    }

    fn freeze_for_stop(&mut self, ending: Ending) {
        if let Mode::Recovering { episode } = &self.mode {
            episode.close();
        }
        self.mode = Mode::Stopping;
        self.ending = Some(ending);
        let held: Vec<R> = self.held.drain(..).map(|(_, reply)| reply).collect();
        let inflight: Vec<R> = self.inflight.drain().map(|(_, (_, reply))| reply).collect();
        for reply in held.into_iter().chain(inflight) {
            self.answer(reply, STOPPING);
        }
    }
}
