//! The failure scenarios: the coordinator killed or paused, an owner killed or paused (and
//! fenced out when it resumes) or cut off from its sidecars, the database stopped for
//! [`OUTAGE`].

use super::*;

pub(super) async fn coordinator(pool: &mut LocalPool, store: &Store, signal: Signal) -> Result<Outcome, Error> {
    let lease = store
        .read_lease()
        .await?
        .ok_or_else(|| Error::Scenario("no coordinator".into()))?;
    let name = lease.holder.split('/').next().unwrap_or_default().to_owned();
    let index = pool
        .gateways
        .iter()
        .position(|g| g.name == name)
        .ok_or_else(|| Error::Scenario(format!("coordinator {name} is not a gateway of this pool")))?;
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &sandboxes);
    let injected = now_ms();
    pool.gateways[index].process.signal(signal)?;
    let started = until(
        "a new coordinator's first fenced write",
        Duration::from_secs(30),
        || async {
            let history = store.lease_history().await?;
            Ok(history
                .iter()
                .find(|t| t.term > lease.term)
                .and_then(|t| t.started_at_ms))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    if signal == Signal::SIGSTOP {
        pool.gateways[index].process.signal(Signal::SIGCONT)?;
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = agent_pids(pool, &sandboxes);
    let end = u64::try_from(started).unwrap_or(0);
    Ok(Outcome::measured(
        format!("{signal} of the coordinator → first fenced write of the next term"),
        (injected, end),
        (pids_before, pids_after),
        &observed,
        format!("coordinator {} term {} → term {}", name, lease.term, lease.term.next()),
    ))
}

/// What befalls the owner in [`owner`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OwnerFault {
    /// A signal to its process (SIGSTOP is followed by SIGCONT once its instances moved).
    Signal(Signal),
    /// The path from its sidecars to its runtime port cut (no reset), the process and its
    /// links to the gateways fine; healed once its instances moved.
    Unreachable,
}

impl std::fmt::Display for OwnerFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Signal(signal) => write!(f, "{signal} of the owner"),
            Self::Unreachable => f.write_str("the owner cut off from its sidecars"),
        }
    }
}

/// Kill, pause or cut off from its sidecars the member owning the most instances; measure
/// until all its instances are active under another owner. A paused owner is resumed, a cut
/// one healed, afterwards: nothing may move back to it, and no answer of its old term may
/// reach a workload.
pub(super) async fn owner(pool: &mut LocalPool, store: &Store, fault: OwnerFault) -> Result<Outcome, Error> {
    let assignments = store.list_assignments().await?;
    let victim = super::busiest(&assignments)?;
    let moved: Vec<(String, gateway::store::OwnershipTerm)> = assignments
        .iter()
        .filter(|a| a.member == victim)
        .map(|a| (a.route.clone(), a.term))
        .collect();
    let routes: Vec<String> = moved.iter().map(|(r, _)| r.clone()).collect();
    let sandboxes: Vec<String> = routes
        .iter()
        .map(|r| r.rsplit('/').next().unwrap_or(r).to_owned())
        .collect();
    let pids_before = agent_pids(pool, &sandboxes);
    let index = pool
        .members
        .iter()
        .position(|m| m.name == victim)
        .ok_or_else(|| Error::Scenario(format!("owner {victim} is not a member of this pool")))?;

    let injected = now_ms();
    match fault {
        OwnerFault::Signal(signal) => pool.members[index].process.signal(signal)?,
        OwnerFault::Unreachable => pool.members[index]
            .path
            .as_ref()
            .ok_or_else(|| Error::Scenario("the pool's runtime ports are not cuttable".into()))?
            .cut(),
    }
    let activated = until(
        "the instances active under a new owner",
        Duration::from_secs(90),
        || async {
            let now = store.list_assignments().await?;
            Ok(all_active_above(&now, &moved, Some(&victim)))
        },
    )
    .await?;
    let end = u64::try_from(activated).unwrap_or(0);
    // Let the agents report through their new owners.
    reporting_after(pool, &sandboxes, end).await?;

    let mut notes = format!("owner {victim} held {}", routes.join(", "));
    let back = match fault {
        OwnerFault::Signal(Signal::SIGSTOP) => {
            pool.members[index].process.signal(Signal::SIGCONT)?;
            Some("resumed")
        }
        OwnerFault::Unreachable => {
            if let Some(path) = &pool.members[index].path {
                path.heal();
            }
            Some("reachable again")
        }
        OwnerFault::Signal(_) => None,
    };
    if let Some(back) = back {
        let resumed = now_ms();
        // The old owner is back; nothing may move back to it, and no answer from its old
        // term may reach a workload.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let after = store.list_assignments().await?;
        let moved_back = after
            .iter()
            .filter(|a| routes.contains(&a.route) && a.member == victim)
            .count();
        if moved_back > 0 {
            return Err(Error::Scenario(format!(
                "{moved_back} instance(s) went back to the {back} owner"
            )));
        }
        let late: usize = sandboxes
            .iter()
            .map(|s| {
                observe(pool, s)
                    .accepted
                    .iter()
                    .filter(|a| a.at_ms > resumed && moved.iter().any(|(_, t)| a.term == Some(t.get())))
                    .count()
            })
            .sum();
        if late > 0 {
            return Err(Error::Scenario(format!(
                "{late} answer(s) from the old owner's term after it was {back}"
            )));
        }
        notes.push_str(&format!(
            "; {back} owner fenced out (no answers from its old term, nothing moved back)"
        ));
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = reported_pids(store, &routes).await?;
    Ok(Outcome::measured(
        format!("{fault} → its instances active under a new owner"),
        (injected, end),
        (pids_before, pids_after),
        &observed,
        notes,
    ))
}

/// Stop the database server for 30 s. Nothing may be stopped early: the workloads keep
/// running under their owners, the coordinator keeps its authority to the end of its lease
/// and no longer (read from its `/metrics`), nothing moves, and the pool has a coordinator
/// again soon after the database returns — measured from its return.
pub(super) async fn outage(
    pool: &LocalPool,
    store: &Store,
    server: &mut crate::postgres::Server,
) -> Result<Outcome, Error> {
    let lease = store
        .read_lease()
        .await?
        .ok_or_else(|| Error::Scenario("no coordinator".into()))?;
    let holder = lease.holder.split('/').next().unwrap_or_default().to_owned();
    let index = pool
        .gateways
        .iter()
        .position(|g| g.name == holder)
        .ok_or_else(|| Error::Scenario(format!("coordinator {holder} is not a gateway of this pool")))?;
    let owners =
        |assignments: Vec<gateway::store::Assignment>| -> BTreeMap<String, (String, gateway::store::OwnershipTerm)> {
            assignments.into_iter().map(|a| (a.route, (a.member, a.term))).collect()
        };
    let before = owners(store.list_assignments().await?);
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &sandboxes);

    let halted = now_ms();
    server.halt().await.map_err(|e| Error::Scenario(e.to_string()))?;
    // The coordinator's authority: held until its lease runs out, then given up.
    let stepped_down = until("the coordinator stepping down", OUTAGE, || async {
        Ok((pool.coordinator_term(index).await == Some(0)).then(now_ms))
    })
    .await?;
    let authority_ms = stepped_down.saturating_sub(halted);
    let lease_ms = pool.config.lease_length_ms;
    if authority_ms > lease_ms + 500 {
        return Err(Error::Scenario(format!(
            "the coordinator kept its authority {authority_ms} ms into the outage, past its {lease_ms} ms lease"
        )));
    }
    let elsewhere = other_coordinator(pool, index).await;
    if let Some(other) = elsewhere {
        return Err(Error::Scenario(format!(
            "{other} claims the coordinator term without a database"
        )));
    }
    tokio::time::sleep(OUTAGE.saturating_sub(Duration::from_millis(now_ms().saturating_sub(halted)))).await;
    let during: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let resumed_at = now_ms();
    let outage_gap = during
        .iter()
        .map(|o| o.max_gap_ms(halted, resumed_at))
        .max()
        .unwrap_or(0);
    let stopped = during.iter().filter(|o| o.last_at_ms() + 2000 < resumed_at).count();
    if stopped > 0 {
        return Err(Error::Scenario(format!(
            "{stopped} workload(s) got no answer in the last 2 s of the outage"
        )));
    }
    server.resume().await.map_err(|e| Error::Scenario(e.to_string()))?;
    let returned = now_ms();
    let coordinating = until(
        "a coordinator after the database returned",
        Duration::from_secs(30),
        || async {
            for g in 0..pool.gateways.len() {
                if pool.coordinator_term(g).await.is_some_and(|t| t > 0) {
                    return Ok(Some(now_ms()));
                }
            }
            Ok(None)
        },
    )
    .await?;
    // A fenced write after the return proves the pool works again, not only the lease.
    until(
        "every agent answered after the return",
        Duration::from_secs(30),
        || async {
            Ok(sandboxes
                .iter()
                .all(|s| observe(pool, s).last_at_ms() > coordinating + 500)
                .then_some(()))
        },
    )
    .await?;
    let after = owners(store.list_assignments().await?);
    if after != before {
        return Err(Error::Scenario(format!(
            "instances moved because of the outage: {before:?} -> {after:?}"
        )));
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = agent_pids(pool, &sandboxes);
    let mut outcome = Outcome::measured(
        format!(
            "database stopped {} s → a coordinator again, from the database's return",
            OUTAGE.as_secs()
        ),
        (returned, coordinating),
        (pids_before, pids_after),
        &observed,
        format!(
            "the coordinator held its authority {authority_ms} ms into the outage (lease {lease_ms} ms); \
             no instance moved; the database took {} ms to start again",
            returned.saturating_sub(resumed_at)
        ),
    );
    // The outage itself, not only the return, is what the workloads lived through.
    outcome.max_counter_gap_ms = outage_gap;
    outcome.refused_answers = observed
        .iter()
        .map(|o| o.refused_between(halted, coordinating + 500))
        .sum();
    Ok(outcome)
}

/// A replica other than `except` that says it holds a coordinator term.
async fn other_coordinator(pool: &LocalPool, except: usize) -> Option<String> {
    for (g, gateway) in pool.gateways.iter().enumerate() {
        if g != except && pool.coordinator_term(g).await.is_some_and(|t| t > 0) {
            return Some(gateway.name.clone());
        }
    }
    None
}

/// Empty the store under the running pool — every table dropped and, on PostgreSQL, every
/// connection to it closed — as a database Pod replaced without its volume, or a restore to
/// an empty database, does. Nothing may be stopped and nothing may move: the gateways migrate
/// the empty schema again, the owners keep their sessions and have their sidecars register
/// again with their fences, and every instance is reserved anew above its fence for the member
/// that runs it — measured until every instance is active again.
pub(super) async fn wipe(pool: &LocalPool, store: &Store) -> Result<Outcome, Error> {
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let assignments = store.list_assignments().await?;
    let runs_on: BTreeMap<String, String> = assignments
        .iter()
        .map(|a| (a.route.clone(), a.member.clone()))
        .collect();
    let before: Vec<(String, gateway::store::OwnershipTerm)> =
        assignments.into_iter().map(|a| (a.route, a.term)).collect();
    let pids_before = agent_pids(pool, &sandboxes);
    let kids = |keys: Vec<gateway::store::SigningKey>| keys.into_iter().map(|k| k.kid).collect::<Vec<_>>();
    let keys_before = kids(store.list_signing_keys().await?);
    // Every replica has loaded the pool's first signing key (they reload every
    // `KEYRING_REFRESH`), as in any pool older than a few seconds.
    let loaded =
        i64::try_from((gateway::credentials::KEYRING_REFRESH + Duration::from_secs(1)).as_millis()).unwrap_or(i64::MAX);
    until(
        "every replica holding the signing keys",
        Duration::from_secs(30),
        || async {
            let now_ms = store.now_ms().await?;
            let keys = store.list_signing_keys().await?;
            Ok(keys.iter().all(|k| k.created_at_ms + loaded < now_ms).then_some(()))
        },
    )
    .await?;
    let wiped = now_ms();
    empty_database(pool.database_url()).await?;
    // Active again: every route assigned above the term it had, and active. The store
    // answers errors until a gateway migrated it again.
    let activated = until(
        "every instance active again after the store was emptied",
        Duration::from_secs(50),
        || async {
            let Ok(now) = store.list_assignments().await else {
                return Ok(None);
            };
            Ok(all_active_above(&now, &before, None))
        },
    )
    .await?;
    let end = u64::try_from(activated).unwrap_or(0);
    reporting_after(pool, &sandboxes, end).await?;
    // The running gateways wrote the keys back: every token and trust bundle delivered before
    // stays valid (a new key would void them until every mounted bundle caught up).
    let keys_after = kids(store.list_signing_keys().await?);
    if keys_after != keys_before {
        return Err(Error::Scenario(format!(
            "the signing keys changed with the store: {keys_before:?} -> {keys_after:?}"
        )));
    }
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    let pids_after = agent_pids(pool, &sandboxes);
    let assignments = store.list_assignments().await?;
    nothing_moved(&runs_on, &assignments, "the store was emptied")?;
    let after: Vec<String> = assignments
        .iter()
        .map(|a| format!("{} at {}", a.route, a.term))
        .collect();
    Ok(Outcome::measured(
        "store emptied → every instance active again above its fence".into(),
        (wiped, end),
        (pids_before, pids_after),
        &observed,
        format!(
            "signing keys kept; terms before: {}; after: {}; nothing moved",
            before
                .iter()
                .map(|(r, t)| format!("{r} at {t}"))
                .collect::<Vec<_>>()
                .join(", "),
            after.join(", ")
        ),
    ))
}

/// Every route of `after` is on the member `runs_on` had it on before `what` happened.
fn nothing_moved(
    runs_on: &BTreeMap<String, String>,
    after: &[gateway::store::Assignment],
    what: &str,
) -> Result<(), Error> {
    let moved: Vec<&str> = after
        .iter()
        .filter(|a| runs_on.get(&a.route).is_some_and(|m| *m != a.member))
        .map(|a| a.route.as_str())
        .collect();
    if moved.is_empty() {
        return Ok(());
    }
    Err(Error::Scenario(format!(
        "routes moved to another member after {what}: {moved:?}"
    )))
}

/// When the last of `routes` became active above its term (under another member than
/// `away_from`); `None` until every one has.
fn all_active_above(
    now: &[gateway::store::Assignment],
    routes: &[(String, gateway::store::OwnershipTerm)],
    away_from: Option<&str>,
) -> Option<i64> {
    let done: Option<Vec<i64>> = routes
        .iter()
        .map(|(route, term)| {
            now.iter()
                .find(|a| &a.route == route && a.term > *term && Some(a.member.as_str()) != away_from)
                .filter(|a| a.phase == AssignmentPhase::Active)
                .map(|a| a.updated_at_ms)
        })
        .collect();
    done.and_then(|times| times.into_iter().max())
}

/// Every agent of `sandboxes` answered later than half a second after `end`.
async fn reporting_after(pool: &LocalPool, sandboxes: &[String], end: u64) -> Result<(), Error> {
    until("every agent reporting again", Duration::from_secs(30), || async {
        Ok(sandboxes
            .iter()
            .all(|s| observe(pool, s).last_at_ms() > end + 500)
            .then_some(()))
    })
    .await
}

/// Drop every table of the database at `url` (PostgreSQL: the `public` schema, then every
/// other connection to the database is closed, as a server replaced under them would).
pub(crate) async fn empty_database(url: &str) -> Result<(), Error> {
    use sqlx::{Connection as _, Executor as _};
    sqlx::any::install_default_drivers();
    let failed = |e: sqlx::Error| Error::Scenario(format!("cannot empty the store: {e}"));
    let mut conn = sqlx::AnyConnection::connect(url).await.map_err(failed)?;
    if url.starts_with("sqlite") {
        let tables: Vec<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
                .fetch_all(&mut conn)
                .await
                .map_err(failed)?;
        conn.execute("PRAGMA foreign_keys = OFF").await.map_err(failed)?;
        for table in tables {
            conn.execute(format!("DROP TABLE IF EXISTS \"{table}\"").as_str())
                .await
                .map_err(failed)?;
        }
    } else {
        conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
            .await
            .map_err(failed)?;
        close_the_others(&mut conn).await.map_err(failed)?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// Close every other connection to `conn`'s PostgreSQL database.
async fn close_the_others(conn: &mut sqlx::AnyConnection) -> Result<(), sqlx::Error> {
    use sqlx::Executor as _;
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .await
    .map(drop)
}

/// Make a PostgreSQL store's commits asynchronous (`on`: acknowledged before their WAL is
/// written) or synchronous again, for every connection: the others are closed, and the pools
/// open new ones under the database's setting. Turning it on also stops the server's WAL
/// writer (SIGSTOP), so what is acknowledged stays in the server's memory: its process id is
/// returned, and killing it (`SIGKILL`, a crash of the server) loses what was not written
/// since (all of it, unless a backend had to write full WAL buffers). Nothing on SQLite
/// (`None`).
pub(crate) async fn commits_asynchronous(url: &str, on: bool) -> Result<Option<nix::unistd::Pid>, Error> {
    use sqlx::{Connection as _, Executor as _};
    if url.starts_with("sqlite") {
        return Ok(None);
    }
    sqlx::any::install_default_drivers();
    let failed = |e: sqlx::Error| Error::Scenario(format!("cannot set the store's commits: {e}"));
    let mut conn = sqlx::AnyConnection::connect(url).await.map_err(failed)?;
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&mut conn)
        .await
        .map_err(failed)?;
    let setting = if on {
        "SET synchronous_commit = off"
    } else {
        "RESET synchronous_commit"
    };
    conn.execute(format!("ALTER DATABASE \"{database}\" {setting}").as_str())
        .await
        .map_err(failed)?;
    close_the_others(&mut conn).await.map_err(failed)?;
    let writer = if on {
        let pid: Option<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
            .fetch_optional(&mut conn)
            .await
            .map_err(failed)?;
        let pid = pid.map(nix::unistd::Pid::from_raw);
        if let Some(pid) = pid {
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP)
                .map_err(|e| Error::Scenario(format!("cannot stop the WAL writer: {e}")))?;
        }
        pid
    } else {
        None
    };
    let _ = conn.close().await;
    Ok(writer)
}

/// The store forgets a drain it acknowledged (an asynchronous replica promoted, a restore
/// from a backup taken before it): the busiest member is drained (and back in service), then
/// the moved routes' assignments and last terms are written back as they were before. Their
/// owners report terms above the store's: each route must be reserved anew above them — for
/// the owner that runs it, so nothing moves — and active again; no workload stopped.
pub(super) async fn rollback(pool: &LocalPool, store: &Store) -> Result<Outcome, Error> {
    let mut client = super::operator(pool).await?;
    let before = store.list_assignments().await?;
    let busiest = super::busiest(&before)?;
    let forgotten: Vec<gateway::store::Assignment> = before.into_iter().filter(|a| a.member == busiest).collect();
    super::emptied(pool, store, &mut client, &busiest).await?;
    let drained: Vec<(String, gateway::store::OwnershipTerm)> = store
        .list_assignments()
        .await?
        .into_iter()
        .filter(|a| forgotten.iter().any(|f| f.route == a.route))
        .map(|a| (a.route, a.term))
        .collect();
    let runs_on: BTreeMap<String, String> = store
        .list_assignments()
        .await?
        .into_iter()
        .map(|a| (a.route, a.member))
        .collect();
    let sandboxes: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &sandboxes);

    let rolled_back = now_ms();
    forget(pool.database_url(), &forgotten).await?;
    let activated = until(
        "every forgotten route active above the term its owner reported",
        Duration::from_secs(50),
        || async {
            let now = store.list_assignments().await?;
            Ok(all_active_above(&now, &drained, None))
        },
    )
    .await?;
    let end = u64::try_from(activated).unwrap_or(0);
    reporting_after(pool, &sandboxes, end).await?;
    let after = store.list_assignments().await?;
    nothing_moved(&runs_on, &after, "the store forgot their terms")?;
    let observed: Vec<Observed> = sandboxes.iter().map(|s| observe(pool, s)).collect();
    Ok(Outcome::measured(
        "store forgot a drain → every route active again above its owner's term".into(),
        (rolled_back, end),
        (pids_before, agent_pids(pool, &sandboxes)),
        &observed,
        format!(
            "{} of {busiest}'s routes forgotten; terms after: {}; nothing moved",
            forgotten.len(),
            after
                .iter()
                .map(|a| format!("{} at {} on {}", a.route, a.term, a.member))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

/// Write `assignments` back as they are given, and their routes' last terms with them: what
/// a store that lost the commits since they were read holds.
pub(crate) async fn forget(url: &str, assignments: &[gateway::store::Assignment]) -> Result<(), Error> {
    use sqlx::Connection as _;
    sqlx::any::install_default_drivers();
    let failed = |e: sqlx::Error| Error::Scenario(format!("cannot roll the store back: {e}"));
    let mut conn = sqlx::AnyConnection::connect(url).await.map_err(failed)?;
    for a in assignments {
        sqlx::query(
            "UPDATE assignments SET member = $2, process_id = $3, term = $4, phase = $5, updated_at_ms = $6 \
             WHERE route = $1",
        )
        .bind(&a.route)
        .bind(&a.member)
        .bind(&a.process_id)
        .bind(a.term)
        .bind(a.phase)
        .bind(a.updated_at_ms)
        .execute(&mut conn)
        .await
        .map_err(failed)?;
        sqlx::query("UPDATE instances SET last_term = $2 WHERE route = $1")
            .bind(&a.route)
            .bind(a.term)
            .execute(&mut conn)
            .await
            .map_err(failed)?;
    }
    let _ = conn.close().await;
    Ok(())
}
