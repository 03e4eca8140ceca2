//! The shared-supervision sidecar, injected beside every workload. It holds the runtime
//! **fence** of its instance (the highest activated term: control from any lower term is
//! refused forever), relays the workload's supervision traffic to the current owner, verifies
//! recovery grants and issues receipts, and enforces the recovery deadline. Contracts:
//! `proto/…/runtime/v1/runtime.proto` (sidecar ⇄ member), `recovery.proto` (grants, proofs,
//! receipts) and `registry.proto` (sidecar → gateway).
//!
//! [`run`] is the whole sidecar; `main.rs` only parses the configuration and signals.

pub mod codec;
pub mod conceal;
pub mod config;
pub mod egress;
mod engine;
pub mod episode;
pub mod fence;
pub mod identity;
pub mod process;
pub mod receipt;
pub mod registration;
pub mod runtime_link;
pub mod state_file;
pub mod supervision;
#[cfg(test)]
mod testkit;
pub mod workload;

use std::sync::Arc;

use proto::registration::{Binding, Material};
use proto::registry::v1::RegisterRequest;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

pub use config::Config;
use engine::{Driver, Inputs, Pinned};
use process::{Exit, Process};
use registration::Registration;
use state_file::{State, StateFile};
use tokio::sync::oneshot;

/// How [`run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The owner released the instance: the workload was stopped and deregistered.
    Released,
    /// The workload process ended on its own; the instance was deregistered.
    Exited,
    /// The recovery deadline passed: the workload was stopped and `ReportRecoveryFailed` sent.
    RecoveryFailed,
    /// The sidecar was asked to shut down (the instance stays registered).
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] config::Error),
    #[error(transparent)]
    StateFile(#[from] state_file::Error),
    #[error(transparent)]
    Socket(#[from] workload::Error),
    #[error(transparent)]
    Process(#[from] process::Error),
    #[error("cannot observe the workload process: {0}")]
    Identity(String),
    #[error("cannot listen for the workload's egress on {0}: {1}")]
    Egress(std::net::SocketAddr, #[source] std::io::Error),
    #[error("cannot open the egress audit spool in the state directory: {0}")]
    Audit(#[source] std::io::Error),
}

/// Runs the sidecar until the instance ends or `shutdown` is cancelled (graceful: streams are
/// closed, a workload the sidecar started is stopped, the instance stays registered). In a
/// Pod (no command), run again after an end, it supervises the workload's next process as
/// the next generation.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<Outcome, Error> {
    config.validate()?;
    let cfg = Arc::new(config);
    let route = cfg.route();
    let file = StateFile::new(&cfg.state_dir);
    let mut state = match file.load()? {
        Some(state) if state.uid == cfg.uid && state.route == route => state,
        Some(_) => {
            warn!("the state directory belongs to another instance; starting a fresh fence");
            // Its audit records are not this instance's.
            let _ = tokio::fs::remove_file(cfg.state_dir.join(egress::audit::FILE)).await;
            State::new(&route, &cfg.uid)
        }
        None => State::new(&route, &cfg.uid),
    };
    if let Some(ended) = &state.ended {
        if !state.next_generation {
            info!(%ended, "this instance already ended; waiting for shutdown");
            shutdown.cancelled().await;
            return Ok(Outcome::Shutdown);
        }
        // The kubelet restarts the workload's container: its next process is supervised as
        // the next generation, once it runs. A Pod being deleted stops the sidecar first
        // (its workload's containers stop before it), so nothing is registered again.
        info!(%ended, generation = state.generation, "the instance ended; waiting for the workload's next process");
        if !identity::wait_for_new_process(state.ended_at_ticks, &shutdown).await {
            return Ok(Outcome::Shutdown);
        }
        info!(
            generation = state.generation + 1,
            "a new process started in the Pod: supervising it as the next generation"
        );
        state = state.next_generation();
        file.save(&state)?;
    }
    let listener = workload::bind(&cfg.socket)?;
    let (pinned, exit) = start_workload(&cfg, &mut state).await?;
    // The receipt key is durable before it is registered.
    file.save(&state)?;

    let registration = Arc::new(Registration::new(
        cfg.gateway_addresses(),
        cfg.gateway_tls(),
        cfg.supervision_dir.clone(),
    ));
    let material = Material::new(
        &Binding {
            route: &route,
            namespace: &cfg.namespace,
            name: &cfg.name,
            uid: &cfg.uid,
        },
        state.receipt_key.as_bytes(),
    );
    let mut register = RegisterRequest {
        route: route.clone(),
        instance: Some(proto::common::v1::InstanceRef {
            namespace: cfg.namespace.clone(),
            name: cfg.name.clone(),
            uid: cfg.uid.clone(),
            generation: state.registering(),
        }),
        registration_material: material.encode(),
        build_version: plumbing::build::version().to_owned(),
        ..RegisterRequest::default()
    };
    let mut standing = registration::Standing::of(&state.fence, pinned.as_ref().map(|p| p.identity.clone()));
    if state.next_generation {
        // The fence's holder ran the generation that ended, not the one asked for.
        standing.holder = None;
    }
    standing.write_into(&mut register);
    let (registered_tx, registered) = mpsc::channel(1);
    let (again_tx, again) = mpsc::channel(1);
    let renewal = tokio::spawn(registration.clone().keep_registered(register, registered_tx, again));
    // Egress is decided here from the revision in force, whatever the owner does meanwhile.
    let (installed_tx, installed) = tokio::sync::watch::channel(state.policy.clone().map(Arc::new));
    let serving = CancellationToken::new();
    // A port the workload holds already leaves it without the proxy (its clients reach its
    // own listener, not the world); supervision goes on.
    let proxy_listener = bind_proxy(cfg.egress_listen).await;
    // The redirect listener is the Pod's only way out: a sidecar that cannot take it (a
    // workload process took the port while it restarted) exits, and the kubelet starts it again.
    let redirect_listener = match cfg.egress_redirect_listen {
        Some(address) => Some((
            address,
            tokio::net::TcpListener::bind(address)
                .await
                .map_err(|err| Error::Egress(address, err))?,
        )),
        None => None,
    };
    let mut egress_tasks = Vec::new();
    let mut spool = None;
    let egress_view = if proxy_listener.is_some() || redirect_listener.is_some() {
        let recent = Arc::new(egress::Recent::default());
        let (recorder, opened) = egress::audit::open(&cfg.state_dir).await.map_err(Error::Audit)?;
        spool = Some(opened);
        let egress = egress::Egress {
            installed: installed.clone(),
            floor: Arc::new(cfg.egress_floor().await),
            limits: egress::Limits::default(),
            recent: recent.clone(),
            // Half the dialer's slots at most for the workload's connections.
            dialer: cfg.dialer().map(|d| d.bounded(plumbing::dialer::MAX_IN_FLIGHT / 2)),
            audit: recorder,
        };
        let policy = state.policy.as_ref().map(|p| (&p.name, p.revision));
        let (mut proxy, mut redirect) = (None, None);
        if let Some((address, listener)) = redirect_listener {
            info!(%address, ?policy, dialer = ?cfg.egress_dialer, "egress redirect listening");
            let original: egress::redirect::Original = Arc::new(egress::redirect::original_destination);
            egress_tasks.push(tokio::spawn(egress::redirect::serve(
                listener,
                egress.clone(),
                original,
                serving.clone(),
            )));
            redirect = Some(address);
        }
        if let Some((address, listener)) = proxy_listener {
            info!(%address, ?policy, "egress proxy listening");
            egress_tasks.push(tokio::spawn(egress::proxy::serve(listener, egress, serving.clone())));
            proxy = Some(address);
        }
        Some(egress::View {
            proxy,
            redirect,
            installed,
            recent,
        })
    } else {
        None
    };
    let (workload_tx, workload_rx) = mpsc::channel(64);
    let (workload_pid, pinned_pid) = tokio::sync::watch::channel(None);
    let observer = workload::Observer::default();
    let finder = (cfg.workload_from_pid_namespace && pinned.is_none())
        .then(|| tokio::spawn(find_workload(workload_tx.clone(), observer.clone(), pinned_pid.clone())));
    let server = tokio::spawn(workload::serve(
        listener,
        workload::Endpoint {
            engine: workload_tx,
            workload: pinned_pid,
            limits: cfg.workload_limits(),
            egress: egress_view,
            observer,
        },
        serving.clone(),
    ));
    let (link_tx, links) = mpsc::channel(256);

    info!(%route, uid = %cfg.uid, fence = state.fence.activated, "sidecar started");
    let mut engine = Driver::new(
        cfg.clone(),
        state,
        file.clone(),
        pinned,
        link_tx,
        workload_pid,
        engine::EgressLink {
            installed: installed_tx,
            spool,
        },
    )
    .registering_again(again_tx);
    let inputs = Inputs {
        links,
        workload: workload_rx,
        registered,
        exit,
    };
    let (ending, exit) = engine.run(inputs, shutdown).await;
    renewal.abort();
    if let Some(finder) = finder {
        finder.abort();
    }
    serving.cancel();
    let outcome = engine.finish(ending, exit, &registration).await;
    let _ = server.await;
    for task in egress_tasks {
        let _ = task.await;
    }
    let _ = std::fs::remove_file(&cfg.socket);
    info!(?outcome, "sidecar finished");
    Ok(outcome)
}

/// A loopback listener for the workload's egress proxy at `address`, when configured and free.
async fn bind_proxy(address: Option<std::net::SocketAddr>) -> Option<(std::net::SocketAddr, tokio::net::TcpListener)> {
    let address = address?;
    match tokio::net::TcpListener::bind(address).await {
        Ok(listener) => Some((address, listener)),
        Err(err) => {
            error!(error = %Error::Egress(address, err), "egress proxy not started");
            None
        }
    }
}

/// How often the Pod's PID namespace is looked at for the workload's main process.
const FIND_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Until the workload is pinned: the one container main process of the Pod besides the
/// sidecar is pinned, as if it had connected to the socket (a workload that never does is
/// supervised too). Several (another app container, another sidecar): none is guessed at, and
/// the workload is identified when it connects.
async fn find_workload(
    engine: mpsc::Sender<workload::Inbound>,
    observer: workload::Observer,
    mut pinned: tokio::sync::watch::Receiver<Option<u32>>,
) {
    let mut told = Vec::new();
    loop {
        if pinned.borrow_and_update().is_some() {
            return;
        }
        let found = identity::container_main_processes().await;
        if let [pid] = found.as_slice() {
            let pid = *pid;
            match observer.pin(&engine, pid).await {
                Ok(workload::Admission::Admitted) => {
                    info!(
                        pid,
                        "workload identified in the Pod's PID namespace: its container's main process"
                    );
                    return;
                }
                Err(err) if told != found => {
                    warn!(pid, error = %err, "cannot observe the Pod's workload process; it is identified when it connects to the socket");
                    told = found;
                }
                _ => {}
            }
        } else if found.len() > 1 && told != found {
            info!(processes = ?found, "several container main processes in the Pod: the workload is identified when it connects to the socket");
            told = found;
        }
        tokio::select! {
            changed = pinned.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(FIND_POLL) => {}
        }
    }
}

/// Starts the configured command, or finds the workload pinned before a restart.
async fn start_workload(
    cfg: &Config,
    state: &mut State,
) -> Result<(Option<Pinned>, Option<oneshot::Receiver<Exit>>), Error> {
    if !cfg.command.is_empty() {
        let child = process::spawn(&cfg.command, &cfg.socket, cfg.egress_listen)?;
        let pid = child.id().unwrap_or(0);
        let (control, exit) = process::watch(Process::Child(child));
        let observed = tokio::task::spawn_blocking(move || identity::observe(pid)).await;
        let identity = match observed {
            Ok(Ok(identity)) => identity,
            Ok(Err(err)) => {
                control.stop(cfg.stop_grace());
                return Err(Error::Identity(err.to_string()));
            }
            Err(err) => {
                control.stop(cfg.stop_grace());
                return Err(Error::Identity(err.to_string()));
            }
        };
        info!(pid, "workload started");
        state.workload = Some((&identity).into());
        return Ok((Some(Pinned { identity, control }), Some(exit)));
    }
    let previous = state.workload.take().map(proto::common::v1::WorkloadIdentity::from);
    match previous {
        Some(identity) if identity::is_running(&identity) => {
            info!(
                pid = identity.pid,
                "still pinned to the workload process from before the restart"
            );
            state.workload = Some((&identity).into());
            let (control, exit) = process::watch(Process::Foreign(identity.clone()));
            Ok((Some(Pinned { identity, control }), Some(exit)))
        }
        _ => Ok((None, None)),
    }
}
