//! The two-signal shutdown every binary shares: the first SIGTERM or SIGINT asks for a drain
//! (leave gracefully, finish what is in flight), the second forces it (stop now).
//!
//! The phases travel on a [`watch`] channel ([`channel`]: a [`Trigger`] and its [`Signal`]);
//! [`on_signals`] escalates a trigger on each signal. A binary that drains on a
//! [`CancellationToken`] takes [`install`]: the token is cancelled on the first signal and the
//! process exits with status 130 on the second.

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The exit status after a second signal (128 + SIGINT, as shells report it).
pub const FORCED_EXIT_STATUS: i32 = 130;

/// Shutdown phases, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Running,
    /// Stop gracefully (first SIGTERM / SIGINT).
    Drain,
    /// Stop now (second signal).
    Force,
}

/// Receiving end. Dropping the [`Trigger`] counts as [`Phase::Drain`] (see [`reached`]).
pub type Signal = watch::Receiver<Phase>;

/// Sending end: advances the phase, never back.
#[derive(Debug)]
pub struct Trigger(watch::Sender<Phase>);

impl Trigger {
    pub fn drain(&self) {
        self.0.send_if_modified(|phase| {
            let advance = *phase < Phase::Drain;
            if advance {
                *phase = Phase::Drain;
            }
            advance
        });
    }

    pub fn force(&self) {
        self.0.send_replace(Phase::Force);
    }

    /// Drain the first time, force the second.
    pub fn escalate(&self) -> Phase {
        if *self.0.borrow() == Phase::Running {
            self.drain();
            Phase::Drain
        } else {
            self.force();
            Phase::Force
        }
    }
}

/// A trigger and its signal, at [`Phase::Running`].
pub fn channel() -> (Trigger, Signal) {
    let (tx, rx) = watch::channel(Phase::Running);
    (Trigger(tx), rx)
}

/// Waits until the phase is at least `phase`; answers the phase reached. A dropped trigger
/// counts as a drain request; nobody can force any more then.
pub async fn reached(rx: &mut Signal, phase: Phase) -> Phase {
    let reached = rx.wait_for(|p| *p >= phase).await.map(|p| *p);
    match reached {
        Ok(p) => p,
        Err(_) if phase <= Phase::Drain => Phase::Drain,
        Err(_) => std::future::pending().await,
    }
}

/// Escalates `trigger` on every SIGTERM and SIGINT (logged), from a task of its own.
pub fn escalate_on_signals(trigger: Trigger) -> std::io::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
            match trigger.escalate() {
                Phase::Force => tracing::warn!("second signal: stopping now"),
                _ => tracing::info!("signal received: draining (send again to stop now)"),
            }
        }
    });
    Ok(())
}

/// A [`Signal`] that SIGTERM and SIGINT escalate.
pub fn on_signals() -> std::io::Result<Signal> {
    let (trigger, signal) = channel();
    escalate_on_signals(trigger)?;
    Ok(signal)
}

/// A token cancelled when `signal` reaches [`Phase::Drain`]; at [`Phase::Force`] the process
/// exits with [`FORCED_EXIT_STATUS`].
pub fn drain_token(mut signal: Signal) -> CancellationToken {
    let drain = CancellationToken::new();
    tokio::spawn({
        let drain = drain.clone();
        async move {
            reached(&mut signal, Phase::Drain).await;
            drain.cancel();
            reached(&mut signal, Phase::Force).await;
            std::process::exit(FORCED_EXIT_STATUS);
        }
    });
    drain
}

/// SIGTERM/SIGINT handling for a binary that drains on a token: cancelled on the first
/// signal, exit on the second.
pub fn install() -> std::io::Result<CancellationToken> {
    Ok(drain_token(on_signals()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn phases_only_advance_and_a_dropped_trigger_drains() {
        let (trigger, mut signal) = channel();
        assert_eq!(trigger.escalate(), Phase::Drain);
        assert_eq!(reached(&mut signal, Phase::Drain).await, Phase::Drain);
        trigger.drain();
        assert_eq!(*signal.borrow(), Phase::Drain);
        assert_eq!(trigger.escalate(), Phase::Force);
        trigger.drain();
        assert_eq!(reached(&mut signal, Phase::Force).await, Phase::Force);

        let (trigger, mut signal) = channel();
        drop(trigger);
        assert_eq!(reached(&mut signal, Phase::Drain).await, Phase::Drain);
    }

    #[tokio::test]
    async fn the_drain_token_is_cancelled_at_the_drain_phase() {
        let (trigger, signal) = channel();
        let token = drain_token(signal);
        assert!(!token.is_cancelled());
        trigger.drain();
        token.cancelled().await;
    }
}
