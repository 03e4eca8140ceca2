//! The timing contract between pool members, sidecars and gateway replicas,
//! in one place. Every side reads its intervals and timeouts from here.
//!
//! The invariants tested below: a member that loses its gateway replica (even
//! an unresponsive one) reconnects elsewhere well inside the membership TTL,
//! so a healthy member is never declared gone because of a gateway failure;
//! and the silence timeout spans several heartbeats.

use std::time::Duration;

/// A member sends a `host.v1.Heartbeat` this often; the gateway answers each.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// Either end of a host stream gives it up after this long without a message
/// from the other (three missed heartbeats). The gateway then ends the
/// member's session and membership at once; the member reconnects.
pub const SILENCE_TIMEOUT: Duration = Duration::from_secs(3);

/// A membership record lives this long unless refreshed.
pub const MEMBERSHIP_TTL: Duration = Duration::from_secs(15);

/// The replica serving a member stream refreshes its record this often.
pub const MEMBERSHIP_REFRESH: Duration = Duration::from_secs(2);

/// Every gateway replica records in the store that it is running this often.
pub const REPLICA_REFRESH: Duration = Duration::from_secs(1);

/// Bound on one connection attempt (TCP, TLS and the first gateway reply).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest bound a reconnecting member gives one attempt. A link whose round trip makes a
/// connect (TCP, TLS, the first reply: about four round trips) slower than
/// [`CONNECT_TIMEOUT`] would otherwise never carry a stream again; after every
/// [`RECONNECT_ATTEMPTS`] attempts in a row that timed out, the bound doubles up to this
/// ([`attempt_timeout`]), and any attempt that got an answer resets it.
pub const CONNECT_TIMEOUT_MAX: Duration = Duration::from_secs(8);

/// The bound on a reconnect attempt after `timed_out` attempts in a row timed out:
/// [`CONNECT_TIMEOUT`], doubled after every [`RECONNECT_ATTEMPTS`] of them, at most
/// [`CONNECT_TIMEOUT_MAX`].
pub fn attempt_timeout(timed_out: u32) -> Duration {
    let doublings = (timed_out / RECONNECT_ATTEMPTS).min(4);
    (CONNECT_TIMEOUT * 2u32.pow(doublings)).min(CONNECT_TIMEOUT_MAX)
}

/// Backoff between reconnect attempts: starts here, doubles, capped below.
pub const RECONNECT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Attempts a member makes, over its gateway endpoints in turn, before it
/// logs a failure and starts the cycle again (it never stops trying).
pub const RECONNECT_ATTEMPTS: u32 = 3;

/// Recovery deadline a snapshot carries unless configured (60 s).
pub const RECOVERY_DEADLINE: Duration = Duration::from_secs(60);

/// Longest recovery deadline a field may ask for (1 h, the gateway's configurable maximum):
/// a larger value from the wire is clamped, so no deadline arithmetic on it can overflow.
pub const MAX_RECOVERY_DEADLINE: Duration = Duration::from_secs(3600);

/// Both ends of a runtime (sidecar ⇄ supervisor) stream heartbeat this often,
/// and treat the stream as dead after the silence timeout.
pub const RUNTIME_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
pub const RUNTIME_SILENCE_TIMEOUT: Duration = Duration::from_secs(3);

/// Minimum spacing of `RecoveryHello` messages from one sidecar.
pub const RECOVERY_HELLO_INTERVAL: Duration = Duration::from_secs(1);

/// A sidecar still recovering this long after its recovery began registers again, saying the
/// term its fence activated (`RegisterRequest.fence_term`), and every
/// [`REGISTER_AGAIN_EVERY`] after that until a term is activated: a registry whose store was
/// emptied or restored from an older backup does not know the instance, so no member will
/// ever be reserved for it until it registers again, and it is then placed above its fence.
/// Later than most recoveries take (a crashed owner's instances move in well under a second, a
/// paused owner's in [`SILENCE_TIMEOUT`] and a little), so an ordinary recovery costs the
/// registry nothing; far within the recovery deadline.
pub const REGISTER_AGAIN_AFTER: Duration = Duration::from_secs(5);
/// See [`REGISTER_AGAIN_AFTER`].
pub const REGISTER_AGAIN_EVERY: Duration = Duration::from_secs(10);

/// An owner that lost its sidecar's stream at its active term, and whose sidecar has not come
/// back for this long, gives the term up (reports it `FAILED`): the sidecar lives (its
/// recovery deadline is far off) but cannot reach this owner — a cut route, a stale conntrack
/// entry, a NetworkPolicy — while the owner is fine towards the gateways. The coordinator then
/// moves the instance to another member, which the sidecar's next `RecoveryHello` reaches; a
/// sidecar that comes back first is attached again and the term is not given up. A sidecar
/// that can reach its owner is back well within it: it notices the silence up to a heartbeat
/// after the owner, its first hello may meet another member that holds it for one
/// [`RECOVERY_HELLO_INTERVAL`] before redirecting it, then one backoff and one connect.
pub const SIDECAR_AWAY_BOUND: Duration = Duration::from_secs(4);

/// Longest lifetime of a recovery grant.
pub const MAX_GRANT_LIFETIME: Duration = Duration::from_secs(30);

/// Clock skew verifiers tolerate on `iat`/`exp` of tokens, grants and proofs.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(5);

/// Time budget of a drain or rebalance whose request gives none.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(600);
/// The largest time budget an operator may give an operation.
pub const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// `WatchSupervisorPool`: statuses that change within this long of the last one sent are
/// coalesced into the next.
pub const WATCH_COALESCE: Duration = Duration::from_millis(100);
/// `WatchSupervisorPool`: a keepalive is sent after this long without a status.
pub const WATCH_KEEPALIVE: Duration = Duration::from_secs(15);
/// A pool watcher that heard nothing (no status, no keepalive) for this long takes the
/// stream for dead and reconnects.
pub const WATCH_SILENCE_TIMEOUT: Duration = Duration::from_secs(2 * WATCH_KEEPALIVE.as_secs() + 5);

/// Supervisor tokens live this long and are renewed at half their lifetime.
pub const SUPERVISOR_TOKEN_LIFETIME: Duration = Duration::from_secs(3600);
/// Instance tokens issued at registration live this long; the sidecar registers again at
/// half their lifetime for a new one.
pub const INSTANCE_TOKEN_LIFETIME: Duration = SUPERVISOR_TOKEN_LIFETIME;

/// Kubernetes: how long a registered instance may go without its Pod in the gateway's Pod
/// watch before the gateway takes the Pod for gone and withdraws the instance (covers the
/// watch's lag behind a sidecar that registers right after its Pod was created).
pub const UNSEEN_POD_GRACE: Duration = Duration::from_secs(30);

/// Kubernetes: how often the coordinator re-checks token Secrets and retries failed writes.
pub const SECRET_RECHECK_INTERVAL: Duration = Duration::from_secs(5);

/// The worst case for a member to reconnect past an unresponsive replica and
/// be refreshed by another: notice the silence, spend every attempt (each
/// bounded by the connect timeout, with the largest backoff between them),
/// then wait for the new replica's first refresh.
pub const fn reconnect_budget() -> Duration {
    let per_attempt = CONNECT_TIMEOUT.as_millis() as u64 + RECONNECT_BACKOFF_MAX.as_millis() as u64;
    Duration::from_millis(
        SILENCE_TIMEOUT.as_millis() as u64
            + RECONNECT_ATTEMPTS as u64 * per_attempt
            + MEMBERSHIP_REFRESH.as_millis() as u64,
    )
}

/// How long a member whose stream a replica ended for silence stays a member. A member cut
/// off from that replica in either direction learns of the end at once (the replica's
/// DEADLINE_EXCEEDED reaches it, or its own silence timeout fires at about the same time) and
/// attaches through another reachable replica well within it (about 0.1 s; a TLS handshake and
/// a TokenReview on a cluster): it moves its stream, not its instances. A hung member's
/// instances move [`SILENCE_TIMEOUT`] plus this after its last message; kept below one
/// [`CONNECT_TIMEOUT`], so that its sidecars, whose first RecoveryHello is redirected to the
/// hung owner and waits out one connect attempt, find the new owner at their next one. A
/// stream the member closed or broke (its process died) ends the membership at once.
pub const DETACHED_GRACE: Duration = Duration::from_millis(500);

/// A member whose stream is held by a replica that has not recorded it is running for this
/// long counts as gone, unless it attached elsewhere since: the other replicas take over the
/// liveness decision of a paused or cut-off replica well before the membership TTL. Long
/// enough for a healthy member behind that replica to notice the same silence and attach
/// elsewhere (the replica's last record may predate its last message by one refresh), so a
/// gateway failure still never makes a healthy member count as gone.
pub const fn replica_silence_bound() -> Duration {
    let per_attempt = CONNECT_TIMEOUT.as_millis() as u64 + RECONNECT_BACKOFF_MAX.as_millis() as u64;
    Duration::from_millis(
        REPLICA_REFRESH.as_millis() as u64
            + SILENCE_TIMEOUT.as_millis() as u64
            + RECONNECT_ATTEMPTS as u64 * per_attempt,
    )
}

/// A gateway replica that has not managed to record in the store that it is running for this
/// long takes itself for cut off from the store: it closes its member streams (UNAVAILABLE) and
/// admits none until it records again, so that its members attach through replicas that can
/// still vouch for them before those take the members of the silent replica for gone
/// ([`replica_silence_bound`]). A replica that cannot write cannot refresh a membership either:
/// answering a member's heartbeats would only hide that nobody vouches for it.
pub const STORE_CUT_OFF: Duration = SILENCE_TIMEOUT;

/// The recovery deadline a `*_recovery_deadline_ms` field means: 0 is the default, and
/// anything above [`MAX_RECOVERY_DEADLINE`] is that maximum.
pub const fn recovery_deadline(field_ms: u64) -> Duration {
    if field_ms == 0 {
        RECOVERY_DEADLINE
    } else if field_ms > MAX_RECOVERY_DEADLINE.as_millis() as u64 {
        MAX_RECOVERY_DEADLINE
    } else {
        Duration::from_millis(field_ms)
    }
}

/// The un-jittered backoff step of attempt `attempt`: doubling, capped.
pub fn backoff_step(attempt: u32) -> Duration {
    RECONNECT_BACKOFF_INITIAL
        .saturating_mul(1u32 << attempt.min(16))
        .min(RECONNECT_BACKOFF_MAX)
}

/// The backoff before reconnect attempt `attempt` (0-based): exponential from
/// [`RECONNECT_BACKOFF_INITIAL`] up to [`RECONNECT_BACKOFF_MAX`], with equal jitter (a
/// uniformly random point in its upper half) so that the sidecars and members of a failed
/// replica or member do not come back in lockstep. Never above the un-jittered step, which
/// the budgets below are computed from.
pub fn reconnect_backoff(attempt: u32) -> Duration {
    let half = backoff_step(attempt) / 2;
    half + half.mul_f64(rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_deadlines_from_the_wire_are_bounded() {
        assert_eq!(recovery_deadline(0), RECOVERY_DEADLINE);
        assert_eq!(recovery_deadline(1_500), Duration::from_millis(1_500));
        for huge in [3_600_001, u64::MAX / 2, u64::MAX] {
            let deadline = recovery_deadline(huge);
            assert_eq!(deadline, MAX_RECOVERY_DEADLINE);
            // What the sidecar does with it must not overflow.
            assert!(std::time::Instant::now().checked_add(deadline).is_some());
        }
    }

    #[test]
    fn backoff_is_jittered_within_the_upper_half_of_its_step() {
        for attempt in [0, 1, 3, 30] {
            let step = backoff_step(attempt);
            let draws: Vec<Duration> = (0..200).map(|_| reconnect_backoff(attempt)).collect();
            assert!(
                draws.iter().all(|d| *d >= step / 2 && *d <= step),
                "{attempt}: {draws:?}"
            );
            let distinct: std::collections::BTreeSet<Duration> = draws.iter().copied().collect();
            assert!(distinct.len() > 10, "jittered, not one value: {distinct:?}");
        }
    }

    #[test]
    fn a_silent_members_grace_ends_before_its_sidecars_next_connect_attempt() {
        // Room for an attach through another replica (its admission refreshes the record),
        // and the hung owner's successor assigned before the sidecars' second RecoveryHello.
        assert!(DETACHED_GRACE >= Duration::from_millis(250));
        assert!(DETACHED_GRACE < CONNECT_TIMEOUT && DETACHED_GRACE < RECOVERY_HELLO_INTERVAL);
        // The paused-owner target: silence, the grace, one connect attempt, the next hello.
        assert!(SILENCE_TIMEOUT + CONNECT_TIMEOUT + RECOVERY_HELLO_INTERVAL <= Duration::from_secs(5));
    }

    #[test]
    fn reconnect_budget_is_well_inside_the_membership_ttl() {
        // "Well inside": a member survives a replica failure with a third of
        // the TTL to spare.
        assert!(
            reconnect_budget() * 3 <= MEMBERSHIP_TTL * 2,
            "reconnect budget {:?} vs TTL {:?}",
            reconnect_budget(),
            MEMBERSHIP_TTL
        );
    }

    #[test]
    fn silence_spans_several_heartbeats_and_refreshes_fit_the_ttl() {
        assert!(SILENCE_TIMEOUT >= HEARTBEAT_INTERVAL * 3);
        assert!(RUNTIME_SILENCE_TIMEOUT >= RUNTIME_HEARTBEAT_INTERVAL * 3);
        assert!(
            MEMBERSHIP_REFRESH * 5 <= MEMBERSHIP_TTL,
            "several refreshes may fail before expiry"
        );
        assert!(SUPERVISOR_TOKEN_LIFETIME / 2 > MEMBERSHIP_TTL);
    }

    #[test]
    fn a_silent_replica_loses_its_members_before_the_ttl_but_after_healthy_ones_reattached() {
        // A healthy member behind the silent replica reattaches within its silence timeout
        // and every attempt (the new replica records it at admission).
        let reattached = reconnect_budget() - MEMBERSHIP_REFRESH;
        assert!(replica_silence_bound() >= REPLICA_REFRESH + reattached);
        assert!(replica_silence_bound() < MEMBERSHIP_TTL);
        assert!(SILENCE_TIMEOUT >= REPLICA_REFRESH * 3);
    }

    #[test]
    fn a_replica_cut_off_from_the_store_lets_its_members_go_before_the_others_count_them_gone() {
        // Noticed at the latest when the write after the last one that landed (started a
        // refresh later) has waited out the cut-off; the member's next attempt may meet the
        // cut-off replica again (refused at once), the one after attaches through another,
        // which records it at admission.
        let noticed = REPLICA_REFRESH + STORE_CUT_OFF;
        let reattached = noticed + (CONNECT_TIMEOUT + RECONNECT_BACKOFF_MAX) * 2;
        assert!(reattached <= replica_silence_bound(), "{reattached:?}");
        assert!(STORE_CUT_OFF >= REPLICA_REFRESH * 3, "a slow write or two is not a cut");
    }

    #[test]
    fn an_owner_its_sidecar_cannot_reach_gives_up_long_before_the_deadline() {
        // A sidecar that can reach its owner is back first: it notices a heartbeat later than
        // the owner, the member its hello met holds it for one hello interval, then a backoff
        // and a connect.
        let back = RUNTIME_HEARTBEAT_INTERVAL + RECOVERY_HELLO_INTERVAL + RECONNECT_BACKOFF_MAX + CONNECT_TIMEOUT;
        assert!(SIDECAR_AWAY_BOUND >= back, "{back:?}");
        // One that cannot is moved with most of the default deadline to spare: both ends'
        // silence, the bound, the move (a refresh) and the sidecar's next hello and connect.
        let moved = RUNTIME_SILENCE_TIMEOUT + SIDECAR_AWAY_BOUND + RECOVERY_HELLO_INTERVAL * 2 + CONNECT_TIMEOUT;
        assert!(moved * 4 <= RECOVERY_DEADLINE, "{moved:?}");
    }

    #[test]
    fn a_slow_link_gets_longer_attempts_only_after_a_round_of_time_outs() {
        // The first round over three replicas is as fast as ever: the reconnect budget holds.
        for n in 0..RECONNECT_ATTEMPTS {
            assert_eq!(attempt_timeout(n), CONNECT_TIMEOUT);
        }
        assert_eq!(attempt_timeout(RECONNECT_ATTEMPTS), CONNECT_TIMEOUT * 2);
        assert_eq!(attempt_timeout(RECONNECT_ATTEMPTS * 2), CONNECT_TIMEOUT * 4);
        assert_eq!(attempt_timeout(u32::MAX), CONNECT_TIMEOUT_MAX);
        // A link of 1 s each way (a connect is about four round trips) connects at the cap.
        assert!(CONNECT_TIMEOUT_MAX >= Duration::from_secs(8));
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        assert_eq!(backoff_step(0), RECONNECT_BACKOFF_INITIAL);
        assert_eq!(backoff_step(1), RECONNECT_BACKOFF_INITIAL * 2);
        assert_eq!(backoff_step(30), RECONNECT_BACKOFF_MAX);
        assert_eq!(recovery_deadline(0), Duration::from_secs(60));
        assert_eq!(recovery_deadline(1500), Duration::from_millis(1500));
    }
}
