//! Coordinator election: every replica campaigns for the lease; the holder
//! renews it and publishes it, and steps down the moment it cannot prove it
//! still holds it. Safety does not rest on this loop — every coordinator
//! write is fenced by the store — but a replica that publishes `None` stops
//! coordinating at once.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::store::{self, Acquire, Lease, Store};

/// The lease timing of one replica.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long an acquired or renewed lease lasts (database clock).
    pub lease_length: Duration,
    /// How often the holder renews: a third of the length, so two renewals
    /// can fail before the lease runs out.
    pub renew_every: Duration,
    /// How often a standby checks the lease (and whether its holder lives).
    pub retry_every: Duration,
}

impl Timing {
    /// The default lease length.
    pub const DEFAULT_LEASE_LENGTH: Duration = Duration::from_secs(5);

    pub fn from_lease_length(lease_length: Duration) -> Self {
        Self {
            lease_length,
            renew_every: lease_length / 3,
            retry_every: (lease_length / 25).clamp(Duration::from_millis(100), Duration::from_secs(1)),
        }
    }
}

impl Default for Timing {
    fn default() -> Self {
        Self::from_lease_length(Self::DEFAULT_LEASE_LENGTH)
    }
}

/// A holder identity unique per process: the replica name and the store's
/// liveness key, by which standbys tell whether the holder still lives.
pub fn holder_id(replica: &str, store: &Store) -> String {
    format!("{replica}/{}", store.liveness_key())
}

/// A live lease whose holder's process is gone (its database connections,
/// or its lock file, vanished with it) is taken over at once with the next
/// term instead of waiting for it to expire.
async fn take_over_if_dead(store: &Store, holder: &str, timing: Timing, row: &store::LeaseView) -> Option<Lease> {
    match timeout(timing.lease_length, store.holder_alive(&row.holder)).await {
        Ok(Ok(false)) => {}
        _ => return None,
    }
    match timeout(
        timing.lease_length,
        store.take_over_lease(holder, timing.lease_length, row),
    )
    .await
    {
        Ok(Ok(lease)) => lease,
        Ok(Err(err)) => {
            warn!(error = %err, "cannot take over the lease of a dead coordinator");
            None
        }
        Err(_) => None,
    }
}

/// Campaign until `shutdown`, publishing the lease this process holds (or
/// `None`) on `publish`. On shutdown a held lease is released gracefully so a
/// standby takes over without waiting for expiry.
pub async fn run(
    store: Store,
    holder: String,
    timing: Timing,
    publish: watch::Sender<Option<Lease>>,
    shutdown: CancellationToken,
) {
    // The lease as held, and the local instant by which it has surely expired
    // in the database too: the request was sent before the database sampled
    // its clock, so `sent + length` is never later than the recorded expiry.
    let mut held: Option<(Lease, Instant)> = None;
    let mut next_attempt = Instant::now();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = sleep_until(next_attempt) => {}
        }
        let sent = Instant::now();
        held = match held.take() {
            None => {
                next_attempt = sent + timing.retry_every;
                match timeout(timing.lease_length, store.acquire_lease(&holder, timing.lease_length)).await {
                    Ok(Ok(Acquire::Acquired(lease))) => {
                        info!(term = lease.term.get(), holder = %holder, "became coordinator");
                        publish.send_replace(Some(lease.clone()));
                        next_attempt = sent + timing.renew_every;
                        Some((lease, sent + timing.lease_length))
                    }
                    Ok(Ok(Acquire::HeldBy(row))) => match take_over_if_dead(&store, &holder, timing, &row).await {
                        Some(lease) => {
                            info!(term = lease.term.get(), holder = %holder, previous = %row.holder, "took over from a dead coordinator");
                            publish.send_replace(Some(lease.clone()));
                            next_attempt = sent + timing.renew_every;
                            Some((lease, sent + timing.lease_length))
                        }
                        None => {
                            debug!(term = row.term.get(), holder = %row.holder, "lease held elsewhere");
                            None
                        }
                    },
                    Ok(Err(err)) => {
                        warn!(error = %err, "cannot campaign for the coordinator lease");
                        None
                    }
                    Err(_) => {
                        warn!("campaign for the coordinator lease timed out");
                        None
                    }
                }
            }
            Some((lease, deadline)) => {
                let budget = deadline.saturating_duration_since(sent);
                let outcome = timeout(budget, store.renew_lease(&lease, timing.lease_length)).await;
                match outcome {
                    Ok(Ok(renewed)) => {
                        publish.send_replace(Some(renewed.clone()));
                        next_attempt = sent + timing.renew_every;
                        Some((renewed, sent + timing.lease_length))
                    }
                    Ok(Err(store::Error::Fenced(why))) => {
                        warn!(term = lease.term.get(), reason = %why, "lost the coordinator lease");
                        publish.send_replace(None);
                        next_attempt = sent + timing.retry_every;
                        None
                    }
                    failed if Instant::now() < deadline => {
                        if let Ok(Err(err)) = failed {
                            warn!(term = lease.term.get(), error = %err, "lease renewal failed; retrying");
                        }
                        next_attempt = Instant::now() + timing.retry_every.min(budget / 4);
                        Some((lease, deadline))
                    }
                    _ => {
                        warn!(
                            term = lease.term.get(),
                            "could not renew the coordinator lease before it ran out; stepping down"
                        );
                        publish.send_replace(None);
                        next_attempt = Instant::now() + timing.retry_every;
                        None
                    }
                }
            }
        };
    }
    if let Some((lease, _)) = held {
        publish.send_replace(None);
        match timeout(timing.lease_length, store.release_lease(&lease)).await {
            Ok(Ok(true)) => info!(term = lease.term.get(), "released the coordinator lease"),
            Ok(Ok(false)) => debug!(term = lease.term.get(), "lease was already lost at release"),
            Ok(Err(err)) => warn!(term = lease.term.get(), error = %err, "could not release the lease; it will expire"),
            Err(_) => warn!(term = lease.term.get(), "lease release timed out; it will expire"),
        }
    }
}
