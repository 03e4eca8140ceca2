//! A simulated pool member: one host stream over real gRPC and TLS that says hello, beats,
//! acks every snapshot and reports what it was given as active (new instances at once as a
//! partial report, everything every 10 s), as a member process would — without hosting
//! anything. It counts the snapshot bytes it receives, applies directory deltas and keeps
//! the launch material it was sent, so that it knows the size of the whole state it holds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use prost::Message as _;
use proto::common::v1::{InstancePhase, RouteDirectoryEntry};
use proto::host::v1::member_message::Kind;
use proto::host::v1::supervisor_host_client::SupervisorHostClient;
use proto::host::v1::{
    Ack, GatewayMessage, Heartbeat, Hello, InstanceStatus, MemberMessage, OwnedInstance, Snapshot, StatusReport,
    gateway_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// How often a simulated member sends a complete report.
const COMPLETE_EVERY: Duration = Duration::from_secs(10);

/// What every simulated member of a run adds to.
#[derive(Debug, Default)]
pub struct Tally {
    pub snapshots: AtomicU64,
    pub snapshot_bytes: AtomicU64,
    /// Instances in the members' latest snapshots, summed.
    pub owned: AtomicUsize,
    /// Encoded size of the whole state the members hold after their latest snapshots (each
    /// as one snapshot with the whole directory and every instance's material), summed.
    pub latest_bytes: AtomicU64,
    /// Streams that ended before the run stopped them.
    pub ended: AtomicU64,
}

/// Attach member `name` (capacity `capacity`) through `channel` with `token`; runs until
/// `stop`.
pub async fn attach(
    channel: Channel,
    token: &str,
    name: &str,
    capacity: u32,
    tally: Arc<Tally>,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, tonic::Status> {
    let (outbound, rx) = mpsc::channel(64);
    let hello = Hello {
        member: name.into(),
        process_id: format!("{name}-sim"),
        connection_epoch: 1,
        runtime_address: format!("https://{name}.invalid:7443"),
        capacity,
        build_version: "scale-simulation".into(),
        process_started_at_ms: 0,
        directory_deltas: true,
    };
    let _ = outbound
        .send(MemberMessage {
            kind: Some(Kind::Hello(hello)),
        })
        .await;
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    plumbing::token::Token::new(token)
        .authorize(&mut request)
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
    let inbound = SupervisorHostClient::new(channel)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .attach(request)
        .await?
        .into_inner();
    Ok(tokio::spawn(drive(inbound, outbound, tally, stop)))
}

async fn drive(
    mut inbound: tonic::Streaming<GatewayMessage>,
    outbound: mpsc::Sender<MemberMessage>,
    tally: Arc<Tally>,
    stop: CancellationToken,
) {
    let mut beat = tokio::time::interval(proto::timing::HEARTBEAT_INTERVAL);
    let mut complete = tokio::time::interval(COMPLETE_EVERY);
    let (mut sequence, mut applied) = (0, 0);
    let mut owned: Vec<OwnedInstance> = Vec::new();
    let mut latest_bytes = 0u64;
    let mut held = Held::default();
    let send = |kind| outbound.send(MemberMessage { kind: Some(kind) });
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = beat.tick() => {
                sequence += 1;
                let _ = send(Kind::Heartbeat(Heartbeat { sequence, monotonic_ms: 0 })).await;
            }
            _ = complete.tick() => {
                if applied > 0 {
                    let _ = send(Kind::StatusReport(report(applied, owned.iter(), false))).await;
                }
            }
            message = inbound.message() => match message {
                Ok(Some(GatewayMessage { kind: Some(gateway_message::Kind::Snapshot(mut snapshot)) })) => {
                    tally.snapshots.fetch_add(1, Ordering::Relaxed);
                    tally.snapshot_bytes.fetch_add(snapshot.encoded_len() as u64, Ordering::Relaxed);
                    let bytes = held.apply(&mut snapshot);
                    tally.latest_bytes.fetch_add(bytes, Ordering::Relaxed);
                    tally.latest_bytes.fetch_sub(latest_bytes, Ordering::Relaxed);
                    latest_bytes = bytes;
                    let _ = send(Kind::Ack(Ack { revision: snapshot.revision })).await;
                    let known: BTreeSet<(&str, u64)> = owned.iter().map(|o| (o.route.as_str(), o.term)).collect();
                    let new: Vec<&OwnedInstance> =
                        snapshot.instances.iter().filter(|o| !known.contains(&(o.route.as_str(), o.term))).collect();
                    applied = snapshot.revision;
                    if !new.is_empty() {
                        let _ = send(Kind::StatusReport(report(applied, new.into_iter(), true))).await;
                    }
                    tally.owned.fetch_add(snapshot.instances.len(), Ordering::Relaxed);
                    tally.owned.fetch_sub(owned.len(), Ordering::Relaxed);
                    owned = snapshot.instances;
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    tally.ended.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
    tally.owned.fetch_sub(owned.len(), Ordering::Relaxed);
    tally.latest_bytes.fetch_sub(latest_bytes, Ordering::Relaxed);
}

/// What a member holds besides its instances: the route directory and the launch material
/// it was sent.
#[derive(Debug, Default)]
struct Held {
    directory: BTreeMap<String, RouteDirectoryEntry>,
    /// Encoded size of `directory` as snapshot field 5.
    directory_bytes: u64,
    material: BTreeMap<String, Vec<u8>>,
}

impl Held {
    /// Apply `snapshot` (its directory is taken out) and return the encoded size of the whole
    /// state held after it.
    fn apply(&mut self, snapshot: &mut Snapshot) -> u64 {
        let size = |e: &RouteDirectoryEntry| prost::encoding::message::encoded_len(5, e) as u64;
        if !snapshot.directory_delta {
            self.directory.clear();
            self.directory_bytes = 0;
        }
        let removed = std::mem::take(&mut snapshot.directory_removed);
        for entry in removed.iter().filter_map(|r| self.directory.remove(r)) {
            self.directory_bytes -= size(&entry);
        }
        for entry in std::mem::take(&mut snapshot.directory) {
            self.directory_bytes += size(&entry);
            if let Some(old) = self.directory.insert(entry.route.clone(), entry) {
                self.directory_bytes -= size(&old);
            }
        }
        snapshot.directory_delta = false;
        self.material
            .retain(|route, _| snapshot.instances.iter().any(|o| &o.route == route));
        let mut whole = snapshot.clone();
        for owned in &mut whole.instances {
            if owned.credentials.is_empty() {
                owned.credentials = self.material.get(&owned.route).cloned().unwrap_or_default();
            } else {
                self.material.insert(owned.route.clone(), owned.credentials.clone());
            }
        }
        whole.encoded_len() as u64 + self.directory_bytes
    }
}

/// Every instance in `owned` active at its term, with a made-up workload PID.
fn report<'a>(applied: u64, owned: impl Iterator<Item = &'a OwnedInstance>, partial: bool) -> StatusReport {
    StatusReport {
        applied_revision: applied,
        instances: owned
            .map(|o| InstanceStatus {
                route: o.route.clone(),
                instance: o.instance.clone(),
                term: o.term,
                phase: InstancePhase::Active as i32,
                workload_pid: 4242,
                ..InstanceStatus::default()
            })
            .collect(),
        partial,
    }
}
