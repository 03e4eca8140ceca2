//! Verifying gateway-signed tokens, shared by every verifier (gateway, supervisor member,
//! sidecar): the [`TrustBundle`] (a JWKS of the gateway's Ed25519 public keys, published by the
//! gateway and mounted as [`TRUST_BUNDLE_FILE`]), [`TrustBundle::verify`], the token kinds
//! ([`Kind`]: audience, header `typ`, longest lifetime) and the claim shapes.
//!
//! Verification order: size bound ([`MAX_TOKEN_BYTES`]) → compact JWS shape → header `alg`
//! must be exactly `EdDSA` (so `none`, HS256 — also an HMAC keyed with a public key — and every
//! other algorithm are refused before any key is looked up) → `crit` refused → `kid` required
//! and present in the bundle → strict Ed25519 signature → `iss`, `aud`, `exp`/`iat`/`nbf` with
//! [`MAX_CLOCK_SKEW`](crate::timing::MAX_CLOCK_SKEW) leeway, the longest lifetime, `typ`.
//! Error messages never quote the token.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signature, VerifyingKey};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::timing::{MAX_CLOCK_SKEW, MAX_GRANT_LIFETIME, SUPERVISOR_TOKEN_LIFETIME};

/// Longest token accepted (compact serialization, bytes).
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// Largest JWKS accepted.
pub const MAX_BUNDLE_BYTES: usize = 64 * 1024;
/// Most keys one JWKS may list.
pub const MAX_BUNDLE_KEYS: usize = 32;
/// Longest `kid`.
pub const MAX_KID_BYTES: usize = 128;
/// The only JWS algorithm signed and accepted.
pub const ALGORITHM: &str = "EdDSA";
/// File name of the trust bundle in a delivery directory or mounted Secret.
pub const TRUST_BUNDLE_FILE: &str = "trust.jwks";
/// File name of the bearer token in a delivery directory or mounted Secret.
pub const TOKEN_FILE: &str = "token";
/// The gateway's default `iss`.
pub const DEFAULT_ISSUER: &str = "openshell-gateway";

/// Audience of supervisor tokens (the pool's members, host stream and recovery RPCs).
pub const SUPERVISOR_AUDIENCE: &str = "openshell-supervisor";
/// Audience of recovery grants and activation proofs (verified by the sidecar).
pub const SIDECAR_AUDIENCE: &str = "openshell-sidecar";
/// Audience of instance tokens (a sidecar calling the registry and its member).
pub const INSTANCE_AUDIENCE: &str = "openshell-instance";
/// Audience of operator tokens (the operator API).
pub const OPERATOR_AUDIENCE: &str = "openshell-operator";
/// Default audience of the projected ServiceAccount tokens sidecars and members present in
/// Kubernetes (the gateway reviews them with exactly this audience).
pub const KUBERNETES_AUDIENCE: &str = "openshell-gateway";

/// Header `typ` of bearer tokens.
pub const JWT_TYP: &str = "JWT";
/// Header `typ` of recovery grants (recovery.proto).
pub const GRANT_TYP: &str = "openshell-recovery-grant+jwt";
/// Header `typ` of activation proofs (recovery.proto).
pub const PROOF_TYP: &str = "openshell-activation-proof+jwt";
/// Longest lifetime of an activation proof (recovery.proto).
pub const MAX_PROOF_LIFETIME: Duration = Duration::from_secs(60);

/// The kinds of token the gateway signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Bearer token of one pool member; subject [`member_subject`].
    Supervisor,
    /// Bearer token of one instance's sidecar; subject [`instance_subject`], extra claims
    /// [`InstanceTokenClaims`].
    Instance,
    /// Bearer token of an operator; extra claims [`OperatorClaims`].
    Operator,
    /// Single-use recovery grant; extra claims [`GrantClaims`].
    RecoveryGrant,
    /// Activation proof; extra claims [`ProofClaims`].
    ActivationProof,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Supervisor,
        Kind::Instance,
        Kind::Operator,
        Kind::RecoveryGrant,
        Kind::ActivationProof,
    ];

    pub fn audience(self) -> &'static str {
        match self {
            Kind::Supervisor => SUPERVISOR_AUDIENCE,
            Kind::Instance => INSTANCE_AUDIENCE,
            Kind::Operator => OPERATOR_AUDIENCE,
            Kind::RecoveryGrant | Kind::ActivationProof => SIDECAR_AUDIENCE,
        }
    }

    pub fn typ(self) -> &'static str {
        match self {
            Kind::RecoveryGrant => GRANT_TYP,
            Kind::ActivationProof => PROOF_TYP,
            Kind::Supervisor | Kind::Instance | Kind::Operator => JWT_TYP,
        }
    }

    /// Longest `exp - iat`. Never above [`SUPERVISOR_TOKEN_LIFETIME`]: the gateway keeps a
    /// retired key published that long, so every token it signed stays verifiable.
    pub fn max_lifetime(self) -> Duration {
        match self {
            Kind::RecoveryGrant => MAX_GRANT_LIFETIME,
            Kind::ActivationProof => MAX_PROOF_LIFETIME,
            Kind::Supervisor | Kind::Instance | Kind::Operator => SUPERVISOR_TOKEN_LIFETIME,
        }
    }
}

/// Subject of the bearer token of pool member `member` (its Pod name in Kubernetes).
pub fn member_subject(member: &str) -> String {
    format!("member:{member}")
}

/// The member a member token's subject names.
pub fn member_of(subject: &str) -> Option<&str> {
    subject.strip_prefix("member:").filter(|m| !m.is_empty())
}

/// Subject of the bearer token of the instance at `route`.
pub fn instance_subject(route: &str) -> String {
    format!("instance:{route}")
}

/// The route an instance token's subject names.
pub fn route_of(subject: &str) -> Option<&str> {
    subject.strip_prefix("instance:").filter(|r| !r.is_empty())
}

/// The `iss` and `exp` of a JWT, read WITHOUT verifying it: only to choose who verifies the
/// token (the gateway's keys, or a Kubernetes TokenReview), and the expiry of a token someone
/// else verified. `None` for anything that is not a bounded, well-formed JWT with a string
/// `iss`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Unverified {
    pub iss: String,
    /// Seconds since the Unix epoch.
    #[serde(default)]
    pub exp: Option<i64>,
}

pub fn unverified(token: &str) -> Option<Unverified> {
    use base64::Engine as _;
    if token.len() > MAX_TOKEN_BYTES {
        return None;
    }
    let mut parts = token.split('.');
    let (_header, payload) = (parts.next()?, parts.next()?);
    parts.next()?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).ok()?;
    serde_json::from_slice::<Unverified>(&bytes).ok()
}

/// The registered claims every gateway token carries, plus the kind's `extra` claims
/// (flattened into the same JSON object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims<E = NoExtra> {
    pub iss: String,
    pub aud: String,
    pub sub: String,
    /// Seconds since the Unix epoch.
    pub iat: i64,
    /// Seconds since the Unix epoch.
    pub exp: i64,
    pub jti: String,
    #[serde(flatten)]
    pub extra: E,
}

/// No claims beyond the registered ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoExtra {}

/// Extra claims of an operator token.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorClaims {
    pub roles: Vec<String>,
}

/// Extra claims of an instance token: the workload it was issued to. `uid` is set in tokens
/// the gateway issues at registration (bound to that Pod), unset in local bootstrap tokens
/// (bound to the route only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceTokenClaims {
    pub namespace: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// The `instance` claim of grants and proofs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceClaim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub generation: i64,
}

/// Extra claims of a recovery grant (recovery.proto); `sub` is the route.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantClaims {
    pub route: String,
    pub instance: InstanceClaim,
    pub term: u64,
    pub member: String,
    pub process_id: String,
}

/// Extra claims of an activation proof (recovery.proto); `sub` is the route.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProofClaims {
    pub route: String,
    pub instance: InstanceClaim,
    pub term: u64,
    pub member: String,
    pub process_id: String,
    pub grant_id: String,
}

/// Why a token or a bundle was refused. Never quotes the token; header values (`alg`, `kid`)
/// appear only when short and plainly printable.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("token is larger than {max} bytes")]
    TooLarge { max: usize },
    #[error("token is malformed: {0}")]
    Malformed(&'static str),
    #[error("token algorithm {0} is not allowed (only EdDSA)")]
    Algorithm(String),
    #[error("token header has no key id (kid)")]
    MissingKid,
    #[error("token key id {0} is not in the trust bundle")]
    UnknownKid(String),
    #[error("token header has critical extensions, none are supported")]
    Critical,
    #[error("token signature does not verify")]
    Signature,
    #[error("token expired")]
    Expired,
    #[error("token is not valid yet")]
    NotYetValid,
    #[error("token lifetime exceeds {max:?}")]
    Lifetime { max: Duration },
    #[error("token audience is not {expected}")]
    Audience { expected: String },
    #[error("token issuer is not {expected}")]
    Issuer { expected: String },
    #[error("token type is not {expected}")]
    Type { expected: String },
    #[error("token claims are invalid: {0}")]
    Claims(&'static str),
    #[error("trust bundle is invalid: {0}")]
    Bundle(String),
    #[error("cannot read trust bundle {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// What a verifier expects of a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expectation<'a> {
    pub audience: &'a str,
    pub issuer: &'a str,
    /// Header `typ` to require, if any.
    pub typ: Option<&'a str>,
    /// Longest `exp - iat` to accept, if bounded.
    pub max_lifetime: Option<Duration>,
}

impl<'a> Expectation<'a> {
    pub fn new(audience: &'a str, issuer: &'a str) -> Self {
        Self {
            audience,
            issuer,
            typ: None,
            max_lifetime: None,
        }
    }

    /// Audience, `typ` and longest lifetime of `kind`.
    pub fn kind(kind: Kind, issuer: &'a str) -> Self {
        Self {
            audience: kind.audience(),
            issuer,
            typ: Some(kind.typ()),
            max_lifetime: Some(kind.max_lifetime()),
        }
    }
}

/// The gateway's public verification keys, by `kid`, and its issuer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustBundle {
    pub issuer: String,
    pub keys: BTreeMap<String, VerifyingKey>,
}

#[derive(Deserialize)]
struct Header {
    alg: Option<String>,
    kid: Option<String>,
    typ: Option<String>,
    crit: Option<Value>,
}

#[derive(Deserialize)]
struct Registered {
    iss: Option<String>,
    /// A single string: the gateway never mints audience arrays, so none is accepted.
    aud: Option<Value>,
    exp: Option<i64>,
    iat: Option<i64>,
    nbf: Option<i64>,
}

impl TrustBundle {
    pub fn new(issuer: impl Into<String>) -> Self {
        Self {
            issuer: issuer.into(),
            keys: BTreeMap::new(),
        }
    }

    /// Parse a JWKS of at most [`MAX_BUNDLE_BYTES`]: `{"issuer": …, "keys": [...]}`. Ed25519
    /// keys (`kty` OKP, `crv` Ed25519, `x`, `kid`) are taken; keys of another type, algorithm
    /// or use are skipped. Refused: no issuer, no usable key, duplicate or missing `kid`, an
    /// invalid or weak key, and any private key material (`d`).
    pub fn from_jwks(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() > MAX_BUNDLE_BYTES {
            return Err(Error::Bundle(format!("larger than {MAX_BUNDLE_BYTES} bytes")));
        }
        let set: Value = serde_json::from_slice(bytes).map_err(|e| Error::Bundle(format!("not JSON: {e}")))?;
        let issuer = match set.get("issuer") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => return Err(Error::Bundle("no issuer".into())),
        };
        let Some(Value::Array(entries)) = set.get("keys") else {
            return Err(Error::Bundle("no keys array".into()));
        };
        if entries.len() > MAX_BUNDLE_KEYS {
            return Err(Error::Bundle(format!("more than {MAX_BUNDLE_KEYS} keys")));
        }
        let mut bundle = Self::new(issuer);
        for entry in entries {
            let Some((kid, key)) = parse_jwk(entry)? else { continue };
            if bundle.keys.insert(kid, key).is_some() {
                return Err(Error::Bundle("duplicate kid".into()));
            }
        }
        if bundle.keys.is_empty() {
            return Err(Error::Bundle("no Ed25519 signing key".into()));
        }
        Ok(bundle)
    }

    /// Read and parse a JWKS file (for example the mounted [`TRUST_BUNDLE_FILE`]), reading at
    /// most [`MAX_BUNDLE_BYTES`] + 1 bytes.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let read_error = |source| Error::Read {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_error)?;
        let mut bytes = Vec::new();
        file.take(MAX_BUNDLE_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(read_error)?;
        Self::from_jwks(&bytes)
    }

    /// The bundle as JWKS JSON, keys in `kid` order.
    pub fn to_jwks(&self) -> String {
        let keys: Vec<Value> = self
            .keys
            .iter()
            .map(|(kid, key)| {
                json!({
                    "kty": "OKP",
                    "crv": "Ed25519",
                    "x": URL_SAFE_NO_PAD.encode(key.as_bytes()),
                    "kid": kid,
                    "alg": ALGORITHM,
                    "use": "sig",
                })
            })
            .collect();
        json!({ "issuer": self.issuer, "keys": keys }).to_string()
    }

    /// Verify `token` against this bundle and `expected` at the system clock, and decode its
    /// claims as `C` (for example [`Claims<GrantClaims>`]).
    pub fn verify<C: DeserializeOwned>(&self, token: &str, expected: &Expectation<'_>) -> Result<C, Error> {
        self.verify_at(token, expected, unix_ms(SystemTime::now()))
    }

    /// [`verify`](Self::verify) at `now_ms` (Unix milliseconds).
    pub fn verify_at<C: DeserializeOwned>(
        &self,
        token: &str,
        expected: &Expectation<'_>,
        now_ms: i64,
    ) -> Result<C, Error> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Error::TooLarge { max: MAX_TOKEN_BYTES });
        }
        let mut parts = token.split('.');
        let (Some(header_b64), Some(payload_b64), Some(signature_b64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Error::Malformed("not three dot-separated parts"));
        };
        let header: Header = serde_json::from_slice(&decode(header_b64)?)
            .map_err(|_| Error::Malformed("header is not a JSON object"))?;
        // The algorithm is pinned before anything else in the token is trusted.
        match header.alg.as_deref() {
            Some(ALGORITHM) => {}
            Some(other) => return Err(Error::Algorithm(printable(other))),
            None => return Err(Error::Algorithm("(missing)".into())),
        }
        if header.crit.is_some() {
            return Err(Error::Critical);
        }
        let kid = header.kid.as_deref().ok_or(Error::MissingKid)?;
        let key = self.keys.get(kid).ok_or_else(|| Error::UnknownKid(printable(kid)))?;
        let signature = Signature::from_slice(&decode(signature_b64)?).map_err(|_| Error::Signature)?;
        let signed = &token[..header_b64.len() + 1 + payload_b64.len()];
        key.verify_strict(signed.as_bytes(), &signature)
            .map_err(|_| Error::Signature)?;

        let payload = decode(payload_b64)?;
        let claims: Registered =
            serde_json::from_slice(&payload).map_err(|_| Error::Claims("registered claims have the wrong shape"))?;
        check_claims(&claims, expected, now_ms)?;
        if let Some(typ) = expected.typ
            && header.typ.as_deref() != Some(typ)
        {
            return Err(Error::Type { expected: typ.into() });
        }
        serde_json::from_slice(&payload).map_err(|_| Error::Claims("claims do not have the expected shape"))
    }
}

fn check_claims(claims: &Registered, expected: &Expectation<'_>, now_ms: i64) -> Result<(), Error> {
    let skew = millis(MAX_CLOCK_SKEW);
    let exp = claims.exp.ok_or(Error::Claims("no exp"))?;
    let iat = claims.iat.ok_or(Error::Claims("no iat"))?;
    let exp_ms = exp.checked_mul(1000).ok_or(Error::Claims("exp out of range"))?;
    let iat_ms = iat.checked_mul(1000).ok_or(Error::Claims("iat out of range"))?;
    if exp <= iat {
        return Err(Error::Claims("exp is not after iat"));
    }
    if now_ms >= exp_ms.saturating_add(skew) {
        return Err(Error::Expired);
    }
    let nbf_ms = match claims.nbf {
        Some(nbf) => nbf.checked_mul(1000).ok_or(Error::Claims("nbf out of range"))?,
        None => i64::MIN,
    };
    if iat_ms.max(nbf_ms) > now_ms.saturating_add(skew) {
        return Err(Error::NotYetValid);
    }
    // `exp - iat` of two in-range claims can still overflow (iat = -9e15 s, exp = 9e15 s):
    // a lifetime that does not fit is longer than any bound.
    if let Some(max) = expected.max_lifetime
        && exp_ms.checked_sub(iat_ms).is_none_or(|lifetime| lifetime > millis(max))
    {
        return Err(Error::Lifetime { max });
    }
    if iat < 0 || claims.nbf.is_some_and(|nbf| nbf < 0) {
        return Err(Error::Claims("a time claim is before the Unix epoch"));
    }
    if claims.iss.as_deref() != Some(expected.issuer) {
        return Err(Error::Issuer {
            expected: expected.issuer.into(),
        });
    }
    if claims.aud.as_ref().and_then(Value::as_str) != Some(expected.audience) {
        return Err(Error::Audience {
            expected: expected.audience.into(),
        });
    }
    Ok(())
}

/// One JWK: `Some((kid, key))` for an Ed25519 signing key, `None` for a key to skip.
fn parse_jwk(entry: &Value) -> Result<Option<(String, VerifyingKey)>, Error> {
    let field = |name: &str| entry.get(name).and_then(Value::as_str);
    if entry.get("d").is_some() {
        return Err(Error::Bundle("a key carries private key material".into()));
    }
    let usable = field("kty") == Some("OKP")
        && field("crv") == Some("Ed25519")
        && field("alg").is_none_or(|alg| alg == ALGORITHM)
        && field("use").is_none_or(|u| u == "sig");
    if !usable {
        return Ok(None);
    }
    let kid = field("kid")
        .filter(|kid| !kid.is_empty() && kid.len() <= MAX_KID_BYTES)
        .ok_or_else(|| Error::Bundle(format!("a key has no kid of 1..={MAX_KID_BYTES} bytes")))?;
    let x = field("x")
        .and_then(|x| URL_SAFE_NO_PAD.decode(x).ok())
        .and_then(|x| <[u8; 32]>::try_from(x.as_slice()).ok())
        .ok_or_else(|| Error::Bundle(format!("key {kid}: x is not 32 base64url bytes")))?;
    let key = VerifyingKey::from_bytes(&x)
        .ok()
        .filter(|key| !key.is_weak())
        .ok_or_else(|| Error::Bundle(format!("key {kid}: not a valid Ed25519 public key")))?;
    Ok(Some((kid.to_owned(), key)))
}

fn decode(part: &str) -> Result<Vec<u8>, Error> {
    URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| Error::Malformed("a part is not unpadded base64url"))
}

/// A header value for an error message: shown only when short and plainly printable.
fn printable(value: &str) -> String {
    let plain = value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.+:".contains(&b));
    if plain {
        value.to_owned()
    } else {
        "(unprintable)".into()
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `t` in Unix milliseconds (0 before the epoch).
pub fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map_or(0, millis)
}

#[cfg(test)]
mod tests;
