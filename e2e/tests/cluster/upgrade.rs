//! Upgrades and rollbacks on the real cluster, as a user makes them: the previous release
//! (`release/previous`) installed with its own overlay and running agents, then `kubectl apply
//! -k` of this build's overlay (every Deployment rolls at once), the old sidecars served
//! through a member crash, a coordinator failover and a drain, a new Pod beside the old ones,
//! and back with `kubectl apply -k` of the release's overlay, through the same again. After
//! each step: no agent restarted or changed process, every counter kept counting and no answer
//! came from a fenced term; the database's Pod outlives both switches.
//!
//! Runs with `OPENSHELL_E2E_CLUSTER=1` and `OPENSHELL_E2E_PREVIOUS_OVERLAY` (the release's test
//! overlay with its images) and `OPENSHELL_E2E_PREVIOUS_VERSION` (what its binaries say in
//! `--version`), which `scripts/test-cluster` sets after building and loading the release.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_rollback_on_a_real_cluster() {
    if std::env::var("OPENSHELL_E2E_CLUSTER").as_deref() != Ok("1") {
        eprintln!("skipped: OPENSHELL_E2E_CLUSTER is not 1 (scripts/test-upgrade runs this test)");
        return;
    }
    let (Ok(previous), Ok(previous_version)) = (
        std::env::var("OPENSHELL_E2E_PREVIOUS_OVERLAY"),
        std::env::var("OPENSHELL_E2E_PREVIOUS_VERSION"),
    ) else {
        eprintln!(
            "skipped: no OPENSHELL_E2E_PREVIOUS_OVERLAY (scripts/test-upgrade builds and loads the previous release)"
        );
        return;
    };
    let this_build = this_build_overlay();
    let mut flow = Flow::new(previous.clone(), None);
    let started = Instant::now();
    flow.step("install the previous release", Flow::install).await;
    flow.step("label a namespace and run agents", Flow::supervise).await;
    let release = previous_version.clone();
    flow.step("the previous release runs everywhere", |f| f.runs_everywhere(release))
        .await;
    let from = previous_version.clone();
    flow.step("upgrade: kubectl apply -k of this build", |f| {
        f.switch(this_build, Switch::Upgrade { from })
    })
    .await;
    flow.through_failures("upgraded pool, old sidecars").await;
    flow.step("a new Pod beside the old ones", Flow::new_beside_old).await;
    flow.step("rollback: kubectl apply -k of the previous release", |f| {
        f.switch(previous, Switch::Rollback(previous_version))
    })
    .await;
    flow.through_failures("rolled-back pool").await;
    flow.step("uninstall", Flow::uninstall).await;
    flow.print_table(started.elapsed());
}

/// Which way a switch of overlays goes.
enum Switch {
    /// From the release to this build: every gateway and member at one other version, the
    /// sidecars unchanged.
    Upgrade { from: String },
    /// Back to the release: every gateway and member at this version.
    Rollback(String),
}

impl Flow {
    /// Every gateway replica, member and sidecar reports `version`.
    async fn runs_everywhere(&mut self, version: String) -> Result<(), Error> {
        let pool = self.pool.clone();
        let status = wait_for(
            &format!("every part of the pool reporting {version}"),
            MINUTE,
            || async {
                let status = pool.status().await.ok()?;
                let everywhere = ["gateway", "member", "sidecar"]
                    .iter()
                    .all(|part| status.versions_of(part) == BTreeSet::from([version.as_str()]));
                everywhere.then_some(status)
            },
        )
        .await?;
        eprintln!("   {} parts at {version}", status.builds.len());
        Ok(())
    }

    /// A member crash, a coordinator failover and a drain, each survived by every agent.
    async fn through_failures(&mut self, pool: &str) {
        if node_local() {
            self.step(
                &format!("{pool}: supervisor process SIGKILLed"),
                Flow::supervisor_killed,
            )
            .await;
        } else {
            self.step(
                &format!("{pool}: supervisor Pod force-deleted"),
                Flow::supervisor_pod_deleted,
            )
            .await;
        }
        self.step(
            &format!("{pool}: coordinator gateway Pod deleted"),
            Flow::coordinator_deleted,
        )
        .await;
        self.step(&format!("{pool}: poolctl drain"), Flow::drain_counted).await;
    }

    /// `kubectl apply -k overlay` while the agents run: every Deployment rolls at once. Waits
    /// until every gateway replica and member runs the switch's build and every instance is
    /// settled; the agents must have survived it, and the database's Pod must be the same.
    async fn switch(&mut self, overlay: String, to: Switch) -> Result<(), Error> {
        let base = self.baseline().await?;
        let before = self.pool.status().await?;
        let sidecars: BTreeSet<String> = before.versions_of("sidecar").into_iter().map(str::to_owned).collect();
        let pool_before: BTreeSet<String> = before.versions_of("member").into_iter().map(str::to_owned).collect();
        let database = self.database_pod().await?;
        self.kubectl.run(&["apply", "-k", &overlay]).await?;
        self.overlay = overlay;
        for deployment in ["openshell-gateway", "openshell-supervisor", "openshell-webhook"] {
            self.rollout_status(deployment, "300s").await?;
        }
        let pool = self.pool.clone();
        let (parts, version) = wait_for(
            "every gateway replica and member at the new build",
            3 * MINUTE,
            || async {
                let status = pool.status().await.ok()?;
                let gateways = status.versions_of("gateway");
                let members = status.versions_of("member");
                let [version] = gateways.iter().copied().collect::<Vec<_>>()[..] else {
                    return None;
                };
                let wanted = match &to {
                    Switch::Upgrade { from } => version != from && !pool_before.contains(version),
                    Switch::Rollback(release) => version == release,
                };
                let live = status.members.iter().filter(|m| m.state == "active").count();
                (wanted && members.len() == 1 && members.contains(version) && live == 2)
                    .then(|| (status.builds.len(), version.to_owned()))
            },
        )
        .await?;
        let status = self.all_settled(&base.names, 2 * MINUTE).await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        check(self.database_pod().await? == database, || {
            "the database's Pod outlived the switch (its image is not the product's)".to_owned()
        })?;
        // The sidecars are the Pods' own: they stay at their builds.
        let after: BTreeSet<String> = status.versions_of("sidecar").into_iter().map(str::to_owned).collect();
        check(after == sidecars, || {
            format!("the sidecars kept their builds {sidecars:?}: {after:?}")
        })?;
        eprintln!(
            "   {parts} parts report; gateways and members at {version}, sidecars at {after:?}; warnings: {:?}",
            status.build_warnings
        );
        // What moved the instances: planned moves only, or recoveries too (a move that met a
        // replica in shutdown and failed its term).
        let query = format!(
            "select kind, count(*) from operations where created_at_ms >= {} group by kind order by kind",
            base.from_ms
        );
        let kinds = self.sql(&query).await?;
        let recoveries: u64 = kinds
            .lines()
            .filter_map(|l| l.strip_prefix("recover|"))
            .filter_map(|n| n.trim().parse::<u64>().ok())
            .sum();
        let listed = kinds.trim().replace('\n', ", ");
        eprintln!(
            "   operations during the switch: {}",
            if listed.is_empty() { "none" } else { &listed }
        );
        // The previous release's members hand their instances over while the gateways roll
        // too; from 0.2 on a member retries a grant or activation that reached no gateway
        // instead of failing the term, so from an 0.2 release on the upgrade makes no recovery.
        // 0.1's members still fall back to one now and then (a figure, not a failure).
        if let Switch::Upgrade { from } = &to
            && line(from) >= (0, 2)
        {
            check(recoveries == 0, || {
                format!("the upgrade moved instances by planned moves only, not recoveries: {kinds}")
            })?;
        }
        let scenario = match to {
            Switch::Upgrade { .. } => "upgrade with kubectl apply -k → every instance settled on the new members",
            Switch::Rollback(_) => "rollback with kubectl apply -k → every instance settled on the release's members",
        };
        match to {
            Switch::Upgrade { .. } => check(status.build_warnings.is_empty(), || {
                format!(
                    "old sidecars under the new pool are within the policy: {:?}",
                    status.build_warnings
                )
            })?,
            // After a rollback a sidecar injected by the newer webhook is newer than the pool:
            // outside the policy, said, and still served (the agents survived it).
            Switch::Rollback(_) => {
                let newer = after.iter().any(|v| line(v) > line(&version));
                check(
                    !newer || status.build_warnings.iter().any(|w| w.contains("newer than the pool")),
                    || format!("a sidecar newer than the pool is named: {:?}", status.build_warnings),
                )?;
            }
        }
        self.survived(scenario, seconds, &base).await
    }

    /// The UID of the database's Pod (dev overlay).
    async fn database_pod(&self) -> Result<String, Error> {
        let pods = self
            .kubectl
            .json(&[
                "get",
                "pods",
                "-n",
                &self.install,
                "-l",
                "app.kubernetes.io/name=openshell-postgres",
            ])
            .await?;
        let uids: Vec<&str> = pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.pointer("/metadata/uid").and_then(Value::as_str))
            .collect();
        match uids[..] {
            [uid] => Ok(uid.to_owned()),
            _ => Err(Error::Check(format!("one database Pod, found {uids:?}"))),
        }
    }

    /// One more replica of the counting Deployment: its Pod gets this build's sidecar from the
    /// new webhook and is supervised beside the Pods with the release's sidecars.
    async fn new_beside_old(&mut self) -> Result<(), Error> {
        let ns = self.namespace.clone();
        let before = self.agent_pods().await?;
        let deployment = self.kubectl.json(&["get", "deployment", "counter", "-n", &ns]).await?;
        let replicas = deployment
            .pointer("/spec/replicas")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let scale = format!("--replicas={}", replicas + 1);
        self.kubectl
            .run(&["scale", "deployment/counter", "-n", &ns, &scale])
            .await?;
        self.kubectl
            .run(&["rollout", "status", "deployment/counter", "-n", &ns, "--timeout=180s"])
            .await?;
        let after = self.agent_pods().await?;
        let new: Vec<&String> = after.keys().filter(|name| !before.contains_key(*name)).collect();
        let [new] = new[..] else {
            return Err(Error::Check(format!("one new agent Pod, found {new:?}")));
        };
        let pod = self.kubectl.json(&["get", "pod", new, "-n", &ns]).await?;
        let injected: Value = pod
            .pointer("/metadata/annotations/supervision.openshell.ai~1injected")
            .and_then(Value::as_str)
            .and_then(|a| serde_json::from_str(a).ok())
            .unwrap_or_default();
        let status = self.pool.status().await?;
        let pool_version = status
            .versions_of("gateway")
            .into_iter()
            .next()
            .unwrap_or_default()
            .to_owned();
        check(injected["version"].as_str() == Some(pool_version.as_str()), || {
            format!("the new Pod was injected by this build's webhook ({pool_version}): {injected}")
        })?;
        let names: BTreeSet<String> = after.keys().cloned().collect();
        self.all_settled(&names, 2 * MINUTE).await?;
        let pool = self.pool.clone();
        let new = new.clone();
        let status = wait_for(
            "the new Pod's workload supervised with its PID, its sidecar's build recorded",
            MINUTE,
            || async {
                let status = pool.status().await.ok()?;
                let supervised = status.of(&ns).iter().any(|i| i.name == new && i.workload_pid != 0);
                (supervised && status.versions_of("sidecar").len() == 2).then_some(status)
            },
        )
        .await?;
        check(status.build_warnings.is_empty(), || {
            format!(
                "old and new sidecars side by side are within the policy: {:?}",
                status.build_warnings
            )
        })?;
        eprintln!("   sidecars at {:?}", status.versions_of("sidecar"));
        // The SupervisorPool object counts the same builds (read every 10 s).
        let (kubectl, install) = (&self.kubectl, self.install.as_str());
        let builds = wait_for(
            "the SupervisorPool's status counts sidecars of both builds",
            MINUTE,
            || async {
                let pool = kubectl
                    .json(&["get", "supervisorpool/openshell", "-n", install])
                    .await
                    .ok()?;
                let builds = pool.pointer("/status/builds")?.as_array()?.clone();
                let sidecars = builds.iter().filter(|b| b["component"] == "sidecar").count();
                (sidecars == 2).then_some(builds)
            },
        )
        .await?;
        eprintln!("   SupervisorPool .status.builds: {}", Value::from(builds));
        Ok(())
    }

    /// A `poolctl drain` of the busiest member, which must count every move it made, and the
    /// member back in service.
    async fn drain_counted(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let member = base.busiest.clone();
        let held = base.status.instances.iter().filter(|i| i.owner == member).count();
        let out = self
            .pool
            .poolctl(&["drain", &member, "--max-parallel", "2", "--wait"])
            .await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        let id = operation_id(&out)?.to_owned();
        let after = self.pool.status().await?;
        check(after.instances.iter().all(|i| i.owner != member), || {
            format!("nothing left on {member} after the drain: {after:?}")
        })?;
        let moves = after.operations.iter().find(|o| o.id == id).map(|o| o.moves);
        check(moves.is_some_and(|moves| moves as usize >= held), || {
            format!("the drain counts the {held} moves it made: {moves:?}")
        })?;
        self.all_settled(&base.names, MINUTE).await?;
        self.survived("poolctl drain of a member (max-parallel 2)", seconds, &base)
            .await?;
        self.pool.poolctl(&["cancel", &id]).await?;
        self.member_active(&member, MINUTE).await
    }
}

/// The release line of a version: the minor before 1.0, the major after (docs/operate.md,
/// "Versions and skew").
fn line(version: &str) -> (u64, u64) {
    let mut parts = version.split(['.', '-', '+']).map(|p| p.parse::<u64>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if major == 0 { (0, minor) } else { (major, 0) }
}
