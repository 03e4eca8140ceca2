//! `probe registry`: a Pod that tries to act for a workload it is not. With its own credential (in Kubernetes its Pod's projected ServiceAccount token, `token`
//! in the directory) it asks the gateway's instance registry to register, withdraw and report a
//! failed recovery for another instance (`--route`, `--uid`), first naming the victim as it is,
//! then claiming its own namespace. Prints one line per call,
//! `probe call=<rpc> claim=<how> code=<gRPC code>`, and exits 0 once every call was answered
//! (the cluster test reads the codes).

use std::path::PathBuf;
use std::time::Duration;

use plumbing::tls::ClientTls;
use proto::common::v1::InstanceRef;
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest, RegisterRequest};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Gateway endpoint.
    #[arg(long, env = "OPENSHELL_GATEWAY_ENDPOINTS")]
    gateway: String,
    /// Directory with `token` (the caller's credential) and `ca.crt`.
    #[arg(long, env = "OPENSHELL_SUPERVISION_DIR")]
    dir: PathBuf,
    /// The victim's route ("<namespace>/<name>").
    #[arg(long)]
    route: String,
    /// The victim's Pod UID.
    #[arg(long)]
    uid: String,
    /// The namespace the probe claims in the second round (its own).
    #[arg(long, env = "OPENSHELL_POD_NAMESPACE")]
    own_namespace: String,
}

fn request<T>(message: T, token: &str) -> anyhow::Result<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    plumbing::token::Token::new(token).authorize(&mut request)?;
    request.set_timeout(Duration::from_secs(10));
    Ok(request)
}

fn code<T>(result: Result<T, tonic::Status>) -> String {
    match result {
        Ok(_) => "Ok".into(),
        Err(status) => format!("{:?}", status.code()),
    }
}

/// Makes every call for both claims and prints each answer's code.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let token = std::fs::read_to_string(args.dir.join(proto::trust::TOKEN_FILE))?;
    let token = token.trim();
    let tls = ClientTls {
        ca: Some(args.dir.join(plumbing::tls::CA_FILE)),
        server_name: None,
        dialer: None,
    };
    let channel = tls.connect(&args.gateway, Duration::from_secs(10)).await?;
    let mut registry = InstanceRegistryClient::new(channel);
    let (namespace, name) = args
        .route
        .split_once('/')
        .ok_or_else(|| anyhow::anyhow!("--route is <namespace>/<name>"))?;
    for (claim, claimed_namespace) in [("victim", namespace), ("own-namespace", args.own_namespace.as_str())] {
        let instance = InstanceRef {
            namespace: claimed_namespace.into(),
            name: name.into(),
            uid: args.uid.clone(),
            generation: 0,
        };
        let register = RegisterRequest {
            route: args.route.clone(),
            instance: Some(instance.clone()),
            registration_material: Vec::new(),
            workload: None,
            build_version: String::new(),
            ..RegisterRequest::default()
        };
        let answer = code(registry.register(request(register, token)?).await);
        println!("probe call=Register claim={claim} code={answer}");
        let deregister = DeregisterRequest {
            route: args.route.clone(),
            instance: Some(instance.clone()),
            reason: "probe".into(),
        };
        let answer = code(registry.deregister(request(deregister, token)?).await);
        println!("probe call=Deregister claim={claim} code={answer}");
        let report = RecoveryFailedRequest {
            route: args.route.clone(),
            instance: Some(instance),
            fence_term: 1,
            reason: "probe".into(),
            ..RecoveryFailedRequest::default()
        };
        let answer = code(registry.report_recovery_failed(request(report, token)?).await);
        println!("probe call=ReportRecoveryFailed claim={claim} code={answer}");
    }
    Ok(())
}
