//! A scripted fake sidecar: one runtime.v1 Connect stream to a member, heartbeating every
//! second in the background, with helpers to answer grant presentations with receipts.

use proto::common::v1::{InstanceRef, WorkloadIdentity};
use proto::recovery::v1::Receipt;
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::supervisor_runtime_client::SupervisorRuntimeClient;
use proto::runtime::v1::{
    Attach, GrantPresentation, Heartbeat, RecoveryHello, SidecarMessage, SupervisorMessage, sidecar_message,
};
use proto::timing;
use proto::trust::{Claims, DEFAULT_ISSUER, Expectation, GrantClaims, Kind as TokenKind, TrustBundle};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status, Streaming};

use super::within;

pub const WORKLOAD_PID: u32 = 4242;

pub fn workload() -> WorkloadIdentity {
    WorkloadIdentity {
        pid: WORKLOAD_PID,
        start_time_ticks: 777,
        exe_digest: vec![9; 32],
    }
}

pub fn attach(route: &str, instance: &InstanceRef, fence_term: u64) -> sidecar_message::Kind {
    sidecar_message::Kind::Attach(Attach {
        route: route.into(),
        instance: Some(instance.clone()),
        fence_term,
        workload: Some(workload()),
    })
}

pub fn recovery_hello(
    route: &str,
    instance: &InstanceRef,
    fence_term: u64,
    relinquished: bool,
) -> sidecar_message::Kind {
    sidecar_message::Kind::RecoveryHello(RecoveryHello {
        route: route.into(),
        instance: Some(instance.clone()),
        fence_term,
        attempt: 1,
        deadline_remaining_ms: 60_000,
        relinquished,
        workload: Some(workload()),
    })
}

pub struct FakeSidecar {
    outbound: mpsc::Sender<SidecarMessage>,
    inbound: Streaming<SupervisorMessage>,
    heartbeats: JoinHandle<()>,
}

impl Drop for FakeSidecar {
    fn drop(&mut self) {
        self.heartbeats.abort();
    }
}

impl FakeSidecar {
    /// Opens a stream to `address` with `token` as bearer and `first` as the first message.
    pub async fn connect(address: &str, token: Option<&str>, first: sidecar_message::Kind) -> Result<Self, Status> {
        let channel = tonic::transport::Endpoint::from_shared(address.to_owned())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let (outbound, queue) = mpsc::channel(64);
        outbound.send(SidecarMessage { kind: Some(first) }).await.unwrap();
        let mut request = tonic::Request::new(ReceiverStream::new(queue));
        if let Some(token) = token {
            let value = MetadataValue::try_from(proto::bearer_value(token)).unwrap();
            request.metadata_mut().insert(proto::AUTHORIZATION_METADATA_KEY, value);
        }
        let inbound = within(
            "the member to answer Connect",
            SupervisorRuntimeClient::new(channel).connect(request),
        )
        .await?
        .into_inner();
        let beat = outbound.clone();
        let heartbeats = tokio::spawn(async move {
            let mut sequence = 0;
            loop {
                tokio::time::sleep(timing::RUNTIME_HEARTBEAT_INTERVAL).await;
                sequence += 1;
                let heartbeat = sidecar_message::Kind::Heartbeat(Heartbeat { sequence });
                if beat.send(SidecarMessage { kind: Some(heartbeat) }).await.is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            outbound,
            inbound,
            heartbeats,
        })
    }

    pub async fn send(&self, kind: sidecar_message::Kind) {
        self.outbound
            .send(SidecarMessage { kind: Some(kind) })
            .await
            .expect("stream open");
    }

    /// The next member message other than a heartbeat; `Err` with the status the stream ended
    /// with (`Code::Ok` for a clean end).
    pub async fn next(&mut self) -> Result<Kind, Status> {
        let deadline = tokio::time::Instant::now() + super::WAIT;
        loop {
            let message = tokio::time::timeout_at(deadline, self.inbound.message())
                .await
                .unwrap_or_else(|_| panic!("timed out waiting for a member message"));
            match message {
                Ok(Some(SupervisorMessage {
                    kind: Some(Kind::Heartbeat(_)),
                })) => continue,
                Ok(Some(SupervisorMessage { kind: Some(kind) })) => return Ok(kind),
                Ok(Some(_)) => panic!("empty member message"),
                Ok(None) => return Err(Status::new(Code::Ok, "stream ended")),
                Err(status) => return Err(status),
            }
        }
    }

    /// The next message, which must exist.
    pub async fn expect(&mut self) -> Kind {
        self.next().await.expect("the member ended the stream")
    }

    /// Waits for the end of the stream and returns its code.
    pub async fn ended(&mut self) -> Code {
        loop {
            if let Err(status) = self.next().await {
                return status.code();
            }
        }
    }

    /// Verifies a grant presentation against `bundle` and answers with a receipt bound to it.
    pub async fn receipt(
        &self,
        presentation: &GrantPresentation,
        bundle: &TrustBundle,
        fenced_term: u64,
    ) -> Claims<GrantClaims> {
        let claims: Claims<GrantClaims> = bundle
            .verify(
                &presentation.grant,
                &Expectation::kind(TokenKind::RecoveryGrant, DEFAULT_ISSUER),
            )
            .expect("the member presented a valid grant");
        assert_eq!(claims.extra.member, presentation.member);
        assert_eq!(claims.extra.process_id, presentation.process_id);
        let i = &claims.extra.instance;
        let receipt = Receipt {
            route: claims.extra.route.clone(),
            instance: Some(InstanceRef {
                namespace: i.namespace.clone(),
                name: i.name.clone(),
                uid: i.uid.clone(),
                generation: i.generation as u64,
            }),
            term: claims.extra.term,
            grant_id: claims.jti.clone(),
            grant_digest: vec![0; 32],
            fenced_term,
            workload: Some(workload()),
            issued_at_ms: super::recovery::unix_s() * 1000,
            mac: vec![0; 32],
        };
        self.send(sidecar_message::Kind::Receipt(receipt)).await;
        claims
    }
}
