//! The fake gateway's `recovery.v1.SupervisorRecovery` (served beside `SupervisorHost`): real
//! Ed25519 grants and activation proofs minted with jsonwebtoken, a trust bundle, every call
//! recorded, and scripted answers (answer, fail, or lose the response by never answering).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use ed25519_dalek::SigningKey;
use ed25519_dalek::pkcs8::EncodePrivateKey;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use proto::common::v1::InstanceRef;
use proto::recovery::v1::supervisor_recovery_server::SupervisorRecovery;
use proto::recovery::v1::{
    ActivateRequest, ActivateResponse, ActivationProof, IssueGrantRequest, IssueGrantResponse, TrustBundleRequest,
    TrustBundleResponse,
};
use proto::trust::{DEFAULT_ISSUER, Kind, TrustBundle};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// A gateway signing key.
#[derive(Clone)]
pub struct Keys {
    pub kid: String,
    secret: SigningKey,
}

impl Keys {
    pub fn new(seed: u8, kid: &str) -> Self {
        Self {
            kid: kid.into(),
            secret: SigningKey::from_bytes(&[seed; 32]),
        }
    }

    pub fn bundle(&self) -> TrustBundle {
        let mut bundle = TrustBundle::new(DEFAULT_ISSUER);
        bundle.keys.insert(self.kid.clone(), self.secret.verifying_key());
        bundle
    }

    /// Signs `extra` claims (merged over the registered ones) as a token of `kind`.
    pub fn mint(&self, kind: Kind, subject: &str, lifetime_s: i64, extra: Value) -> String {
        let now = unix_s();
        let mut claims = json!({
            "iss": DEFAULT_ISSUER, "aud": kind.audience(), "sub": subject,
            "iat": now, "exp": now + lifetime_s, "jti": uuid::Uuid::new_v4().to_string(),
        });
        if let (Some(claims), Value::Object(extra)) = (claims.as_object_mut(), extra) {
            claims.extend(extra);
        }
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(self.kid.clone());
        header.typ = Some(kind.typ().to_owned());
        let der = self.secret.to_pkcs8_der().unwrap();
        jsonwebtoken::encode(&header, &claims, &EncodingKey::from_ed_der(der.as_bytes())).unwrap()
    }

    /// The instance token of the workload at `route` ("<namespace>/<name>"), bound to `uid`
    /// when given.
    pub fn instance_token(&self, route: &str, uid: Option<&str>) -> String {
        let (namespace, name) = route.split_once('/').unwrap_or((route, route));
        let mut claims = json!({ "namespace": namespace, "name": name });
        if let Some(uid) = uid {
            claims["uid"] = json!(uid);
        }
        self.mint(Kind::Instance, &proto::trust::instance_subject(route), 600, claims)
    }
}

pub fn unix_s() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

/// How the next call of a kind is answered.
#[derive(Debug, Clone)]
pub enum Script {
    Answer,
    Fail(tonic::Code, &'static str),
    /// The call is received and processed, its response never arrives.
    LoseResponse,
}

/// A recovery call as the fake gateway received it.
#[derive(Debug, Clone)]
pub enum Call {
    Issue(IssueGrantRequest),
    Activate(ActivateRequest),
}

#[derive(Default)]
struct State {
    issue_script: Vec<Script>,
    activate_script: Vec<Script>,
    issued: Vec<IssueGrantRequest>,
    activated: Vec<ActivateRequest>,
    /// jti -> grant, as minted.
    grants: BTreeMap<String, String>,
    /// Instances by route, for grant claims (default: `support::instance(route)`).
    instances: BTreeMap<String, InstanceRef>,
    bearer_tokens: Vec<Option<String>>,
}

#[derive(Clone)]
pub struct Recovery {
    pub keys: Keys,
    state: Arc<Mutex<State>>,
    calls: mpsc::UnboundedSender<Call>,
}

impl Recovery {
    pub fn new(keys: Keys) -> (Self, mpsc::UnboundedReceiver<Call>) {
        let (calls, receiver) = mpsc::unbounded_channel();
        let recovery = Self {
            keys,
            state: Arc::default(),
            calls,
        };
        (recovery, receiver)
    }

    /// Scripts the next IssueGrant answers, in order (then: answer).
    pub fn script_issue(&self, scripts: &[Script]) {
        self.state.lock().unwrap().issue_script = scripts.iter().rev().cloned().collect();
    }

    /// Scripts the next Activate answers, in order (then: answer).
    pub fn script_activate(&self, scripts: &[Script]) {
        self.state.lock().unwrap().activate_script = scripts.iter().rev().cloned().collect();
    }

    pub fn place(&self, route: &str, instance: InstanceRef) {
        self.state.lock().unwrap().instances.insert(route.into(), instance);
    }

    pub fn issued(&self) -> Vec<IssueGrantRequest> {
        self.state.lock().unwrap().issued.clone()
    }

    pub fn activated(&self) -> Vec<ActivateRequest> {
        self.state.lock().unwrap().activated.clone()
    }

    /// Bearer tokens of every IssueGrant and Activate call.
    pub fn bearer_tokens(&self) -> Vec<Option<String>> {
        self.state.lock().unwrap().bearer_tokens.clone()
    }

    fn instance(&self, route: &str) -> InstanceRef {
        let state = self.state.lock().unwrap();
        state
            .instances
            .get(route)
            .cloned()
            .unwrap_or_else(|| super::instance(route))
    }

    async fn play(script: Option<Script>) -> Result<(), Status> {
        match script.unwrap_or(Script::Answer) {
            Script::Answer => Ok(()),
            Script::Fail(code, message) => Err(Status::new(code, message)),
            Script::LoseResponse => std::future::pending().await,
        }
    }
}

fn instance_claim(instance: &InstanceRef) -> Value {
    json!({"namespace": instance.namespace, "name": instance.name, "uid": instance.uid,
        "generation": instance.generation})
}

#[tonic::async_trait]
impl SupervisorRecovery for Recovery {
    async fn issue_grant(&self, request: Request<IssueGrantRequest>) -> Result<Response<IssueGrantResponse>, Status> {
        let token = proto::bearer_token_from_metadata(request.metadata()).map(str::to_owned);
        let request = request.into_inner();
        let instance = self.instance(&request.route);
        let script = {
            let mut state = self.state.lock().unwrap();
            state.issued.push(request.clone());
            state.bearer_tokens.push(token);
            state.issue_script.pop()
        };
        let _ = self.calls.send(Call::Issue(request.clone()));
        let jti = uuid::Uuid::new_v4().to_string();
        let grant = self.keys.mint(
            Kind::RecoveryGrant,
            &request.route,
            30,
            json!({"route": request.route, "instance": instance_claim(&instance), "term": request.term,
                "member": request.member, "process_id": request.process_id, "jti": jti}),
        );
        self.state.lock().unwrap().grants.insert(jti.clone(), grant.clone());
        Self::play(script).await?;
        Ok(Response::new(IssueGrantResponse {
            grant,
            grant_id: jti,
            expires_at_ms: (unix_s() + 30) * 1000,
            instance: Some(instance),
        }))
    }

    async fn activate(&self, request: Request<ActivateRequest>) -> Result<Response<ActivateResponse>, Status> {
        let token = proto::bearer_token_from_metadata(request.metadata()).map(str::to_owned);
        let request = request.into_inner();
        let script = {
            let mut state = self.state.lock().unwrap();
            state.activated.push(request.clone());
            state.bearer_tokens.push(token);
            state.activate_script.pop()
        };
        let _ = self.calls.send(Call::Activate(request.clone()));
        let receipt = request
            .receipt
            .clone()
            .ok_or_else(|| Status::invalid_argument("no receipt"))?;
        let minted = self.state.lock().unwrap().grants.get(&receipt.grant_id).cloned();
        if minted.as_deref() != Some(request.grant.as_str()) {
            return Err(Status::failed_precondition(
                "the receipt is not bound to a grant minted here",
            ));
        }
        Self::play(script).await?;
        let claims: proto::trust::Claims<proto::trust::GrantClaims> = self
            .keys
            .bundle()
            .verify(
                &request.grant,
                &proto::trust::Expectation::kind(Kind::RecoveryGrant, DEFAULT_ISSUER),
            )
            .unwrap();
        let instance = receipt.instance.clone().unwrap_or_default();
        let proof = self.keys.mint(
            Kind::ActivationProof,
            &receipt.route,
            60,
            json!({"route": receipt.route, "instance": instance_claim(&instance), "term": receipt.term,
                "member": claims.extra.member, "process_id": claims.extra.process_id,
                "grant_id": receipt.grant_id}),
        );
        Ok(Response::new(ActivateResponse {
            activation: Some(ActivationProof {
                route: receipt.route,
                instance: Some(instance),
                term: receipt.term,
                activated_at_ms: unix_s() * 1000,
                proof,
                grant_id: receipt.grant_id,
            }),
        }))
    }

    async fn trust_bundle(
        &self,
        _request: Request<TrustBundleRequest>,
    ) -> Result<Response<TrustBundleResponse>, Status> {
        Ok(Response::new(TrustBundleResponse {
            jwks_json: self.keys.bundle().to_jwks(),
            issuer: DEFAULT_ISSUER.into(),
            refresh_after_ms: 0,
        }))
    }
}
