//! `poolctl`, the operator's command line for the pool (the `poolctl` binary is a thin shell
//! around [`run`]): status, drain, rebalance (either also as a dry run) and cancel through the operator API of any
//! gateway replica, with an operator token. Rendering is pure and tested without I/O.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, GetSupervisorPoolStatusRequest, GetSupervisorPoolStatusResponse, MemberState,
    Operation, OperationKind, OperationPhase, OperationPlan, StartSupervisorPoolOperationRequest,
};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

/// Bound on connecting to a gateway and on each call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often `--wait` and `status --watch` poll.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

#[derive(Debug, Parser)]
#[command(name = "poolctl", version, about = "Operate a shared-supervision pool")]
pub struct Cli {
    /// Gateway gRPC endpoints (comma-separated); the first that answers is used.
    #[arg(long, env = "OPENSHELL_GATEWAY_ENDPOINTS", value_delimiter = ',', required = true)]
    pub gateway: Vec<String>,
    /// File holding an operator token (platform-admin role).
    #[arg(long, env = "OPENSHELL_OPERATOR_TOKEN_FILE")]
    pub token_file: PathBuf,
    /// PEM CA bundle that verifies https:// gateways.
    #[arg(long, env = "OPENSHELL_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Verify the gateway's certificate against this name instead of the URL's host.
    #[arg(long, env = "OPENSHELL_GATEWAY_TLS_NAME")]
    pub gateway_tls_name: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Coordinator, members, instances and operations.
    Status {
        /// Print again every half second until interrupted.
        #[arg(long)]
        watch: bool,
        /// Output format: a table for people, or one JSON document (per frame with --watch).
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Move every instance off a member and keep it out of placement (until cancelled).
    Drain {
        /// The member (its Pod name in Kubernetes).
        member: String,
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Even out instance counts across eligible members.
    Rebalance {
        #[command(flatten)]
        run: RunArgs,
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Cancel an operation (a succeeded drain: return the member to service).
    Cancel {
        /// The operation id.
        id: String,
    },
}

/// How `status` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Concurrent moves, 1..=8.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub max_parallel: u32,
    /// Time budget in seconds (0: the gateway's default).
    #[arg(long, default_value_t = 0)]
    pub timeout_secs: u64,
    /// Wait for the operation to finish, showing progress.
    #[arg(long)]
    pub wait: bool,
}

/// Dry runs of drain and rebalance.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Only list the moves the operation would make (and why any would not happen); records
    /// nothing and moves nothing. Exits 1 when the operation would not finish.
    #[arg(long, conflicts_with = "wait")]
    pub dry_run: bool,
    /// Output format of the dry run or of the started operation.
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the operator token {path}: {source}")]
    Token {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the operator token is not valid gRPC metadata")]
    TokenFormat,
    #[error("no gateway answered: {0}")]
    Connect(String),
    #[error("{0}")]
    Call(#[from] tonic::Status),
    #[error("operation {id} ended {phase}: {message}")]
    Ended { id: String, phase: String, message: String },
    #[error("the operation would not finish: {0}")]
    WouldNotFinish(String),
}

/// A connected operator client.
pub struct Client {
    pool: SupervisorPoolClient<Channel>,
    token: MetadataValue<tonic::metadata::Ascii>,
}

impl Client {
    pub async fn connect(cli: &Cli) -> Result<Self, Error> {
        let raw = tokio::fs::read_to_string(&cli.token_file)
            .await
            .map_err(|source| Error::Token {
                path: cli.token_file.display().to_string(),
                source,
            })?;
        let mut token = MetadataValue::try_from(proto::bearer_value(raw.trim())).map_err(|_| Error::TokenFormat)?;
        token.set_sensitive(true);
        let mut errors = Vec::new();
        for url in &cli.gateway {
            let endpoint = match proto::tls::endpoint(url, cli.tls_ca.as_deref(), cli.gateway_tls_name.as_deref()).await
            {
                Ok(endpoint) => endpoint.connect_timeout(CALL_TIMEOUT).timeout(CALL_TIMEOUT),
                Err(err) => {
                    errors.push(err.to_string());
                    continue;
                }
            };
            match tokio::time::timeout(CALL_TIMEOUT, endpoint.connect()).await {
                Ok(Ok(channel)) => {
                    return Ok(Self {
                        pool: SupervisorPoolClient::new(channel),
                        token,
                    });
                }
                Ok(Err(err)) => errors.push(format!("{url}: {err}")),
                Err(_) => errors.push(format!("{url}: timed out")),
            }
        }
        Err(Error::Connect(errors.join("; ")))
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert(proto::AUTHORIZATION_METADATA_KEY, self.token.clone());
        request
    }

    pub async fn status(&mut self) -> Result<GetSupervisorPoolStatusResponse, Error> {
        let request = self.request(GetSupervisorPoolStatusRequest {});
        Ok(self.pool.get_supervisor_pool_status(request).await?.into_inner())
    }

    pub async fn start(
        &mut self,
        kind: OperationKind,
        target: &str,
        run: &RunArgs,
    ) -> Result<(Operation, bool), Error> {
        let request = self.request(StartSupervisorPoolOperationRequest {
            kind: kind as i32,
            target: target.to_owned(),
            max_parallel: run.max_parallel,
            timeout_ms: run.timeout_secs.saturating_mul(1000),
            dry_run: false,
        });
        let answer = self.pool.start_supervisor_pool_operation(request).await?.into_inner();
        let op = answer
            .operation
            .ok_or_else(|| tonic::Status::internal("the gateway answered without the operation"))?;
        Ok((op, answer.created))
    }

    /// A dry run: the moves the operation would make; nothing is recorded.
    pub async fn plan(&mut self, kind: OperationKind, target: &str, run: &RunArgs) -> Result<OperationPlan, Error> {
        let request = self.request(StartSupervisorPoolOperationRequest {
            kind: kind as i32,
            target: target.to_owned(),
            max_parallel: run.max_parallel,
            timeout_ms: run.timeout_secs.saturating_mul(1000),
            dry_run: true,
        });
        let answer = self.pool.start_supervisor_pool_operation(request).await?.into_inner();
        Ok(answer
            .plan
            .ok_or_else(|| tonic::Status::internal("the gateway answered a dry run without a plan"))?)
    }

    pub async fn cancel(&mut self, id: &str) -> Result<Operation, Error> {
        let request = self.request(CancelSupervisorPoolOperationRequest { id: id.to_owned() });
        let answer = self.pool.cancel_supervisor_pool_operation(request).await?.into_inner();
        Ok(answer
            .operation
            .ok_or_else(|| tonic::Status::internal("the gateway answered without the operation"))?)
    }

    /// Poll until operation `id` is finished, showing a progress bar of `total` moves.
    pub async fn wait(&mut self, id: &str, total: u64) -> Result<Operation, Error> {
        let bar = indicatif::ProgressBar::new(total.max(1));
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} [{elapsed}] {bar:30} {pos}/{len} moves  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        loop {
            let status = self.status().await?;
            let op = status.operations.iter().find(|o| o.id == id).cloned();
            let Some(op) = op else {
                bar.abandon_with_message("the operation is gone from the status");
                return Err(Error::Call(tonic::Status::not_found(format!("no operation {id}"))));
            };
            bar.set_length(total.max(u64::from(op.moves)).max(1));
            bar.set_position(u64::from(op.moves));
            bar.set_message(op.message.clone());
            if is_finished(&op) {
                bar.finish_with_message(op.message.clone());
                return if op.phase == OperationPhase::Succeeded as i32 {
                    Ok(op)
                } else {
                    Err(Error::Ended {
                        id: op.id.clone(),
                        phase: phase_name(op.phase),
                        message: op.message.clone(),
                    })
                };
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

fn is_finished(op: &Operation) -> bool {
    [
        OperationPhase::Succeeded,
        OperationPhase::Failed,
        OperationPhase::Cancelled,
    ]
    .iter()
    .any(|p| *p as i32 == op.phase)
}

/// Run one command; what to print goes to stdout.
pub async fn run(cli: Cli) -> Result<(), Error> {
    let mut client = Client::connect(&cli).await?;
    match &cli.command {
        Command::Status { watch, output } => loop {
            let status = client.status().await?;
            if *output == Output::Json {
                println!("{}", render_json(&status));
            } else {
                if *watch {
                    // Clear the screen between frames.
                    print!("\x1b[2J\x1b[H");
                }
                println!("{}", render(&status));
            }
            if !watch {
                return Ok(());
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        },
        Command::Drain { member, run, plan } if plan.dry_run => {
            dry_run(&mut client, OperationKind::Drain, member, run, plan.output).await
        }
        Command::Rebalance { run, plan } if plan.dry_run => {
            dry_run(&mut client, OperationKind::Rebalance, "", run, plan.output).await
        }
        Command::Drain { member, run, plan } => {
            let total = client
                .status()
                .await?
                .members
                .iter()
                .find(|m| &m.name == member)
                .map_or(0, |m| u64::from(m.instance_count));
            let (op, created) = client.start(OperationKind::Drain, member, run).await?;
            started(&op, created, plan.output);
            if run.wait {
                client.wait(&op.id, total).await?;
            }
            Ok(())
        }
        Command::Rebalance { run, plan } => {
            let (op, created) = client.start(OperationKind::Rebalance, "", run).await?;
            started(&op, created, plan.output);
            if run.wait {
                client.wait(&op.id, 0).await?;
            }
            Ok(())
        }
        Command::Cancel { id } => {
            let op = client.cancel(id).await?;
            println!("{}", render_operation(&op));
            Ok(())
        }
    }
}

fn started(op: &Operation, created: bool, output: Output) {
    if output == Output::Json {
        let mut json = operation_json(op);
        json["created"] = created.into();
        println!("{json}");
        return;
    }
    let verb = if created { "started" } else { "already running" };
    println!("{verb}: {}", render_operation(op));
}

async fn dry_run(
    client: &mut Client,
    kind: OperationKind,
    target: &str,
    run: &RunArgs,
    output: Output,
) -> Result<(), Error> {
    let plan = client.plan(kind, target, run).await?;
    match output {
        Output::Json => println!("{}", render_plan_json(&plan)),
        Output::Table => print!("{}", render_plan(&plan)),
    }
    if plan.completes {
        Ok(())
    } else {
        Err(Error::WouldNotFinish(plan.message))
    }
}

/// A dry run for people: the moves by wave, then what would not move.
pub fn render_plan(plan: &OperationPlan) -> String {
    let mut out = format!(
        "dry run (nothing recorded) over the pool as {} read it: {} moves, {}\n",
        plan.served_by,
        plan.moves.len(),
        if plan.completes {
            "would succeed"
        } else {
            "would not finish"
        }
    );
    if !plan.moves.is_empty() {
        out.push_str(&format!(
            "{:>4}  {:<28} {:<16} {:<16} {:>5}\n",
            "WAVE", "INSTANCE", "FROM", "TO", "TERM"
        ));
        for m in &plan.moves {
            out.push_str(&format!(
                "{:>4}  {:<28} {:<16} {:<16} {:>5}\n",
                m.wave, m.route, m.from_member, m.to_member, m.term
            ));
        }
    }
    if !plan.refused.is_empty() {
        out.push_str(&format!("{:<28} {:<16} {}\n", "NOT MOVED", "FROM", "WHY"));
        for r in &plan.refused {
            out.push_str(&format!("{:<28} {:<16} {}\n", r.route, r.from_member, r.reason));
        }
    }
    out.push_str(&format!("outcome: {}\n", plan.message));
    if !plan.existing_operation_id.is_empty() {
        out.push_str(&format!(
            "note: operation {} is equivalent: a real request returns it instead of starting another\n",
            plan.existing_operation_id
        ));
    }
    out
}

/// A dry run for programs.
pub fn render_plan_json(plan: &OperationPlan) -> serde_json::Value {
    use serde_json::json;
    json!({
        "dryRun": true,
        "completes": plan.completes,
        "message": plan.message,
        "servedBy": plan.served_by,
        "observedAtMs": plan.observed_at_ms,
        "existingOperationId": plan.existing_operation_id,
        "moves": plan.moves.iter().map(|m| json!({
            "route": m.route,
            "from": m.from_member,
            "to": m.to_member,
            "term": m.term,
            "wave": m.wave,
        })).collect::<Vec<_>>(),
        "refused": plan.refused.iter().map(|r| json!({
            "route": r.route,
            "from": r.from_member,
            "reason": r.reason,
        })).collect::<Vec<_>>(),
    })
}

fn phase_name(phase: i32) -> String {
    let name = OperationPhase::try_from(phase).unwrap_or_default().as_str_name();
    name.strip_prefix("OPERATION_PHASE_")
        .unwrap_or(name)
        .to_ascii_lowercase()
}

/// One operation on one line.
pub fn render_operation(op: &Operation) -> String {
    let kind = OperationKind::try_from(op.kind).unwrap_or_default().as_str_name();
    let kind = kind
        .strip_prefix("OPERATION_KIND_")
        .unwrap_or(kind)
        .to_ascii_lowercase();
    let target = if op.target.is_empty() { "-" } else { op.target.as_str() };
    format!(
        "{} {kind} {target} {} moves={} parallel={} by={} — {}",
        op.id,
        phase_name(op.phase),
        op.moves,
        op.max_parallel,
        op.requested_by,
        op.message
    )
}

/// The name of a protobuf enum value without its type prefix, lower case.
fn enum_name(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase()
}

/// Pool status for programs: one JSON document with the same facts as the table.
pub fn render_json(status: &GetSupervisorPoolStatusResponse) -> serde_json::Value {
    use serde_json::json;
    let members: Vec<_> = status
        .members
        .iter()
        .map(|m| {
            let state = MemberState::try_from(m.state).unwrap_or_default().as_str_name();
            json!({
                "name": m.name,
                "processId": m.process_id,
                "state": enum_name(state, "MEMBER_STATE_"),
                "instances": m.instance_count,
                "capacity": m.capacity,
                "runtimeAddress": m.runtime_address,
                "servedBy": m.served_by,
            })
        })
        .collect();
    let instances: Vec<_> = status
        .instances
        .iter()
        .map(|i| {
            let phase = proto::common::v1::InstancePhase::try_from(i.phase)
                .unwrap_or_default()
                .as_str_name();
            let instance = i.instance.clone().unwrap_or_default();
            json!({
                "route": i.route,
                "namespace": instance.namespace,
                "name": instance.name,
                "uid": instance.uid,
                "owner": i.owner_member,
                "term": i.term,
                "reserved": i.reserved,
                "phase": enum_name(phase, "INSTANCE_PHASE_"),
                "workloadPid": i.workload_pid,
                "progress": i.progress,
                "message": i.message,
            })
        })
        .collect();
    let operations: Vec<_> = status.operations.iter().map(operation_json).collect();
    json!({
        "coordinator": status.coordinator.as_ref().map(|c| json!({"holder": c.holder, "term": c.term})),
        "servedBy": status.served_by,
        "members": members,
        "instances": instances,
        "operations": operations,
    })
}

/// One operation for programs.
pub fn operation_json(o: &Operation) -> serde_json::Value {
    let kind = OperationKind::try_from(o.kind).unwrap_or_default().as_str_name();
    serde_json::json!({
        "id": o.id,
        "kind": enum_name(kind, "OPERATION_KIND_"),
        "target": o.target,
        "phase": phase_name(o.phase),
        "moves": o.moves,
        "maxParallel": o.max_parallel,
        "message": o.message,
        "requestedBy": o.requested_by,
    })
}

/// Pool status for people: a compact table.
pub fn render(status: &GetSupervisorPoolStatusResponse) -> String {
    let mut out = String::new();
    let coordinator = status
        .coordinator
        .as_ref()
        .map_or_else(|| "none".to_owned(), |c| format!("{} (term {})", c.holder, c.term));
    out.push_str(&format!(
        "coordinator: {coordinator}   status from: {}\n",
        status.served_by
    ));
    out.push_str(&format!(
        "{:<16} {:<10} {:<9} {:>9} {:>8}  {}\n",
        "MEMBER", "PROCESS", "STATE", "INSTANCES", "CAPACITY", "SERVED BY"
    ));
    for m in &status.members {
        let state = MemberState::try_from(m.state).unwrap_or_default().as_str_name();
        out.push_str(&format!(
            "{:<16} {:<10} {:<9} {:>9} {:>8}  {}\n",
            m.name,
            short(&m.process_id),
            state
                .strip_prefix("MEMBER_STATE_")
                .unwrap_or(state)
                .to_ascii_lowercase(),
            m.instance_count,
            m.capacity,
            m.served_by
        ));
    }
    if !status.instances.is_empty() {
        out.push_str(&format!(
            "{:<28} {:<16} {:>5} {:<12} {:>8} {:>9}\n",
            "INSTANCE", "OWNER", "TERM", "PHASE", "PID", "PROGRESS"
        ));
        for i in &status.instances {
            let phase = proto::common::v1::InstancePhase::try_from(i.phase)
                .unwrap_or_default()
                .as_str_name();
            let phase = phase
                .strip_prefix("INSTANCE_PHASE_")
                .unwrap_or(phase)
                .to_ascii_lowercase();
            let phase = if i.reserved { format!("{phase}*") } else { phase };
            out.push_str(&format!(
                "{:<28} {:<16} {:>5} {:<12} {:>8} {:>9}\n",
                i.route, i.owner_member, i.term, phase, i.workload_pid, i.progress
            ));
        }
    }
    let open: Vec<&Operation> = status
        .operations
        .iter()
        // Open ones, and succeeded drains (their member stays out until cancelled).
        .filter(|o| {
            !is_finished(o) || (o.phase == OperationPhase::Succeeded as i32 && o.kind == OperationKind::Drain as i32)
        })
        .collect();
    if !open.is_empty() {
        out.push_str("OPERATIONS\n");
        for op in open {
            out.push_str(&render_operation(op));
            out.push('\n');
        }
    }
    out
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::pool::v1::{Coordinator, Member};

    fn drain(phase: OperationPhase) -> Operation {
        Operation {
            id: "op-1".into(),
            kind: OperationKind::Drain as i32,
            target: "supervisor-0".into(),
            phase: phase as i32,
            message: "moving 2 instances off supervisor-0".into(),
            moves: 1,
            max_parallel: 2,
            requested_by: "local-operator".into(),
            ..Operation::default()
        }
    }

    #[test]
    fn shows_coordinator_members_and_open_operations() {
        let status = GetSupervisorPoolStatusResponse {
            coordinator: Some(Coordinator {
                holder: "gateway-0/abc".into(),
                term: 3,
                expires_at_ms: 0,
            }),
            members: vec![Member {
                name: "supervisor-0".into(),
                process_id: "0123456789".into(),
                state: MemberState::Draining as i32,
                instance_count: 2,
                capacity: 256,
                served_by: "gateway-1".into(),
                ..Member::default()
            }],
            operations: vec![drain(OperationPhase::Running)],
            served_by: "gateway-0".into(),
            ..GetSupervisorPoolStatusResponse::default()
        };
        let text = render(&status);
        assert!(text.contains("coordinator: gateway-0/abc (term 3)"), "{text}");
        assert!(
            text.contains("supervisor-0") && text.contains("01234567 ") && text.contains("draining"),
            "{text}"
        );
        assert!(
            text.contains("op-1 drain supervisor-0 running moves=1 parallel=2"),
            "{text}"
        );
    }

    #[test]
    fn finished_operations_are_not_listed_but_a_drained_member_is() {
        let mut status = GetSupervisorPoolStatusResponse {
            operations: vec![drain(OperationPhase::Cancelled)],
            ..GetSupervisorPoolStatusResponse::default()
        };
        assert!(!render(&status).contains("OPERATIONS"));
        status.operations = vec![drain(OperationPhase::Succeeded)];
        assert!(render(&status).contains("op-1 drain supervisor-0 succeeded"));
    }

    #[test]
    fn a_dry_run_prints_moves_by_wave_and_what_would_not_move() {
        use proto::pool::v1::{PlannedMove, RefusedMove};
        let plan = OperationPlan {
            moves: vec![PlannedMove {
                route: "team-a/agent-0".into(),
                from_member: "supervisor-0".into(),
                to_member: "supervisor-1".into(),
                term: 4,
                wave: 1,
            }],
            refused: vec![RefusedMove {
                route: "team-a/agent-1".into(),
                from_member: "supervisor-0".into(),
                reason: "all 1 eligible pool members are at capacity (supervisor-1 holds 2 of 2)".into(),
            }],
            completes: false,
            message: "waiting: all 1 eligible pool members are at capacity".into(),
            served_by: "gateway-1".into(),
            ..OperationPlan::default()
        };
        let text = render_plan(&plan);
        assert!(
            text.contains("nothing recorded") && text.contains("would not finish"),
            "{text}"
        );
        assert!(
            text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["1", "team-a/agent-0", "supervisor-0", "supervisor-1", "4"]),
            "{text}"
        );
        assert!(
            text.contains("team-a/agent-1") && text.contains("holds 2 of 2"),
            "{text}"
        );
        let json = render_plan_json(&plan);
        assert_eq!(json["moves"][0]["to"], "supervisor-1");
        assert_eq!(json["refused"][0]["route"], "team-a/agent-1");
        assert_eq!(json["completes"], false);
    }

    #[test]
    fn dry_run_takes_an_output_format_and_not_wait() {
        let base = ["poolctl", "--gateway", "x", "--token-file", "/t"];
        let parse = |rest: &[&str]| Cli::try_parse_from(base.iter().chain(rest));
        let cli = parse(&["drain", "supervisor-0", "--dry-run", "-o", "json"]).unwrap();
        let Command::Drain { plan, .. } = cli.command else {
            panic!("a drain")
        };
        assert!(plan.dry_run && plan.output == Output::Json);
        assert!(parse(&["rebalance", "--dry-run"]).is_ok());
        assert!(
            parse(&["rebalance", "--dry-run", "--wait"]).is_err(),
            "a dry run has nothing to wait for"
        );
    }

    #[test]
    fn the_command_line_reads_env_and_bounds_max_parallel() {
        let cli = Cli::try_parse_from([
            "poolctl",
            "--gateway",
            "https://a:8443,https://b:8443",
            "--token-file",
            "/t",
            "drain",
            "supervisor-0",
            "--max-parallel",
            "2",
            "--wait",
        ])
        .unwrap();
        assert_eq!(cli.gateway.len(), 2);
        let Command::Drain { member, run, .. } = cli.command else {
            panic!("a drain")
        };
        assert_eq!((member.as_str(), run.max_parallel, run.wait), ("supervisor-0", 2, true));
        let too_many = Cli::try_parse_from([
            "poolctl",
            "--gateway",
            "x",
            "--token-file",
            "/t",
            "rebalance",
            "--max-parallel",
            "9",
        ]);
        assert!(too_many.is_err());
    }
}
