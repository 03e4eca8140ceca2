//! The planned moves through the operator API: a drain and a rebalance, measured from the
//! request to the operation's success.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Planned {
    Drain,
    Rebalance,
}

/// An operator client of the pool over every replica.
pub(crate) async fn operator(pool: &LocalPool) -> Result<poolctl::Client, Error> {
    pool.operator(pool.endpoints())
        .await
        .map_err(|e| Error::Scenario(format!("operator client: {e}")))
}

/// The member owning the most instances.
pub(crate) fn busiest(assignments: &[gateway::store::Assignment]) -> Result<String, Error> {
    let mut load: BTreeMap<&str, usize> = BTreeMap::new();
    for a in assignments {
        *load.entry(a.member.as_str()).or_default() += 1;
    }
    load.into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(m, _)| m.to_owned())
        .ok_or_else(|| Error::Scenario("no owner".into()))
}

fn op_error(e: poolctl::Error) -> Error {
    Error::Scenario(format!("operation: {e}"))
}

/// Drain `member` (max_parallel 2) until its instances moved, then cancel the drain so it
/// takes instances again: an empty member back in service.
pub(crate) async fn emptied(
    pool: &LocalPool,
    store: &Store,
    client: &mut poolctl::Client,
    member: &str,
) -> Result<(), Error> {
    let run = poolctl::RunArgs {
        max_parallel: 2,
        timeout_secs: 120,
        wait: true,
    };
    let (drain, _) = client
        .start(proto::pool::v1::OperationKind::Drain, member, &run)
        .await
        .map_err(op_error)?;
    client
        .wait(&drain.id, &mut poolctl::Progress::quiet())
        .await
        .map_err(op_error)?;
    steady(pool, store).await?;
    client.cancel(&drain.id).await.map_err(op_error)?;
    until(
        "the drained member back in service",
        Duration::from_secs(30),
        || async {
            let ops = store.list_operations().await?;
            Ok(ops
                .iter()
                .any(|o| o.id == drain.id && o.phase == gateway::store::OperationPhase::Cancelled)
                .then_some(()))
        },
    )
    .await
}

/// Drain: move the two sessions of the busiest member off it (max_parallel 2); measured from
/// the request to the operation's success. Rebalance: first drain a member and return it to
/// service (so it is empty), then even out; measured from the rebalance request to its success.
pub(crate) async fn planned(pool: &LocalPool, store: &Store, kind: Planned) -> Result<Outcome, Error> {
    let mut client = operator(pool).await?;
    let run = |parallel| poolctl::RunArgs {
        max_parallel: parallel,
        timeout_secs: 120,
        wait: true,
    };
    let member = busiest(&store.list_assignments().await?)?;
    if kind == Planned::Rebalance {
        emptied(pool, store, &mut client, &member).await?;
    }
    let before = store.list_assignments().await?;
    let moving: Vec<(String, gateway::store::OwnershipTerm)> = match kind {
        Planned::Drain => before
            .iter()
            .filter(|a| a.member == member)
            .map(|a| (a.route.clone(), a.term))
            .collect(),
        Planned::Rebalance => before.iter().map(|a| (a.route.clone(), a.term)).collect(),
    };
    let all: Vec<String> = pool.sandboxes.iter().map(|s| s.name.clone()).collect();
    let pids_before = agent_pids(pool, &all);
    let started = now_ms();
    let (op, proto_kind) = match kind {
        Planned::Drain => (
            client
                .start(proto::pool::v1::OperationKind::Drain, &member, &run(2))
                .await
                .map_err(op_error)?,
            "drain",
        ),
        Planned::Rebalance => (
            client
                .start(proto::pool::v1::OperationKind::Rebalance, "", &run(2))
                .await
                .map_err(op_error)?,
            "rebalance",
        ),
    };
    let done = client
        .wait(&op.0.id, &mut poolctl::Progress::quiet())
        .await
        .map_err(op_error)?;
    let finished = store
        .list_operations()
        .await?
        .into_iter()
        .find(|o| o.id == done.id)
        .map_or(0, |o| u64::try_from(o.updated_at_ms).unwrap_or(0));
    let after = store.list_assignments().await?;
    let moved: Vec<String> = moving
        .iter()
        .filter(|(route, term)| after.iter().any(|a| &a.route == route && a.term > *term))
        .map(|(route, _)| route.clone())
        .collect();
    let end = finished.max(started);
    until(
        "every agent reporting after the moves",
        Duration::from_secs(30),
        || async {
            Ok(all
                .iter()
                .all(|s| observe(pool, s).last_at_ms() > end + 500)
                .then_some(()))
        },
    )
    .await?;
    let observed: Vec<Observed> = all.iter().map(|s| observe(pool, s)).collect();
    let pids_after = agent_pids(pool, &all);
    Ok(Outcome::measured(
        format!("{proto_kind} request (max_parallel 2) → operation succeeded"),
        (started, end),
        (pids_before, pids_after),
        &observed,
        format!("{} moved ({}); {}", moved.len(), moved.join(", "), done.message),
    ))
}
