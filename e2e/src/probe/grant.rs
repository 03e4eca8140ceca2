//! `probe grant`: a pool member that tries to take the recovery grants of terms reserved for
//! another member. With one member's credential (in the cluster test a token of the
//! supervisor ServiceAccount bound to that member's Pod, `token` in the directory) it asks
//! the gateway, round after round for `--seconds`, for the grant of every `--route`'s next
//! terms, naming every `--process` it was told (the other members' process ids, which every
//! member reads in its route directory), once as itself (`--member`) and once as the member
//! the term is reserved for (`--as`). Prints one line per claim and answer code,
//! `probe call=IssueGrant claim=<how> code=<gRPC code> count=N`, and exits 0.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use plumbing::tls::ClientTls;
use proto::recovery::v1::IssueGrantRequest;
use proto::recovery::v1::supervisor_recovery_client::SupervisorRecoveryClient;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Gateway endpoint.
    #[arg(long, env = "OPENSHELL_GATEWAY_ENDPOINTS")]
    gateway: String,
    /// Directory with `token` (the member's credential) and `ca.crt`.
    #[arg(long, env = "OPENSHELL_SUPERVISION_DIR")]
    dir: PathBuf,
    /// The member whose credential the probe holds.
    #[arg(long)]
    member: String,
    /// The member the terms are reserved for (claimed in the second round).
    #[arg(long = "as")]
    victim: String,
    /// A process id to name (repeatable).
    #[arg(long = "process", required = true)]
    processes: Vec<String>,
    /// `<route>=<term>`: the route's current term; the next three are asked for (repeatable).
    #[arg(long = "route", required = true)]
    routes: Vec<String>,
    /// How long to keep asking.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
}

/// Terms asked for beyond each route's current one.
const TERMS_AHEAD: u64 = 3;
/// Pause between rounds.
const ROUND_PAUSE: Duration = Duration::from_millis(100);

pub async fn run(args: Args) -> anyhow::Result<()> {
    let token = std::fs::read_to_string(args.dir.join(proto::trust::TOKEN_FILE))?;
    let token = plumbing::token::Token::new(token.trim());
    let tls = ClientTls {
        ca: Some(args.dir.join(plumbing::tls::CA_FILE)),
        server_name: None,
        dialer: None,
    };
    let channel = tls.connect(&args.gateway, Duration::from_secs(10)).await?;
    let mut recovery = SupervisorRecoveryClient::new(channel);
    let routes = args
        .routes
        .iter()
        .map(|r| {
            let (route, term) = r
                .rsplit_once('=')
                .ok_or_else(|| anyhow::anyhow!("--route is <route>=<term>: {r}"))?;
            Ok((route.to_owned(), term.parse::<u64>()?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    println!("probe grant: started");
    let mut answers: BTreeMap<(&str, String), u64> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut round = 0u64;
    while Instant::now() < deadline {
        round += 1;
        println!("probe grant: round {round}");
        for (route, current) in &routes {
            for term in current + 1..=current + TERMS_AHEAD {
                for process_id in &args.processes {
                    for (claim, member) in [("self", &args.member), ("victim", &args.victim)] {
                        let mut request = tonic::Request::new(IssueGrantRequest {
                            route: route.clone(),
                            term,
                            member: member.clone(),
                            process_id: process_id.clone(),
                        });
                        token.authorize(&mut request)?;
                        request.set_timeout(Duration::from_secs(10));
                        let code = match recovery.issue_grant(request).await {
                            Ok(_) => "Ok".to_owned(),
                            Err(status) => format!("{:?}", status.code()),
                        };
                        *answers.entry((claim, code)).or_default() += 1;
                    }
                }
            }
        }
        tokio::time::sleep(ROUND_PAUSE).await;
    }
    for ((claim, code), count) in answers {
        println!("probe call=IssueGrant claim={claim} code={code} count={count}");
    }
    Ok(())
}
