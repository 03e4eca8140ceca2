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
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    const NOW_MS: i64 = 1_700_000_000_000;
    const ISS: &str = DEFAULT_ISSUER;

    fn signing_key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn bundle() -> TrustBundle {
        let mut b = TrustBundle::new(ISS);
        b.keys.insert("k1".into(), signing_key(1).verifying_key());
        b
    }

    fn b64(v: &Value) -> String {
        URL_SAFE_NO_PAD.encode(v.to_string())
    }

    fn sign(header: &Value, claims: &Value, key: &SigningKey) -> String {
        let input = format!("{}.{}", b64(header), b64(claims));
        let sig = key.sign(input.as_bytes());
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig.to_bytes()))
    }

    fn claims(aud: &str, iat_s: i64, exp_s: i64) -> Value {
        json!({"iss": ISS, "aud": aud, "sub": "pool:p", "iat": iat_s, "exp": exp_s, "jti": "j1"})
    }

    fn good(claims: &Value) -> String {
        sign(
            &json!({"alg": "EdDSA", "kid": "k1", "typ": "JWT"}),
            claims,
            &signing_key(1),
        )
    }

    fn now_s() -> i64 {
        NOW_MS / 1000
    }

    fn verify(token: &str) -> Result<Claims, Error> {
        bundle().verify_at(token, &Expectation::kind(Kind::Supervisor, ISS), NOW_MS)
    }

    #[test]
    fn a_good_token_verifies_and_decodes() {
        let token = good(&claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60));
        let c = verify(&token).unwrap();
        assert_eq!((c.sub.as_str(), c.aud.as_str()), ("pool:p", SUPERVISOR_AUDIENCE));
    }

    #[test]
    fn expiry_has_leeway_of_the_clock_skew_and_no_more() {
        let skew_s = MAX_CLOCK_SKEW.as_secs() as i64;
        let exp = now_s() - skew_s + 1;
        assert!(verify(&good(&claims(SUPERVISOR_AUDIENCE, exp - 60, exp))).is_ok());
        let exp = now_s() - skew_s;
        assert!(matches!(
            verify(&good(&claims(SUPERVISOR_AUDIENCE, exp - 60, exp))),
            Err(Error::Expired)
        ));
        let iat = now_s() + skew_s + 1;
        assert!(matches!(
            verify(&good(&claims(SUPERVISOR_AUDIENCE, iat, iat + 60))),
            Err(Error::NotYetValid)
        ));
    }

    #[test]
    fn algorithm_is_pinned_before_the_key_lookup() {
        let c = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60);
        // An unknown kid with a wrong alg reports the algorithm: no lookup happened.
        for alg in ["none", "HS256", "ES256", "RS256", "eddsa", "EdDSA "] {
            let token = format!("{}.{}.", b64(&json!({"alg": alg, "kid": "nope"})), b64(&c));
            assert!(matches!(verify(&token), Err(Error::Algorithm(_))), "{alg}");
        }
        let token = format!("{}.{}.", b64(&json!({"kid": "k1"})), b64(&c));
        assert!(matches!(verify(&token), Err(Error::Algorithm(_))));
    }

    #[test]
    fn kid_crit_signature_and_shape_are_checked() {
        let c = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60);
        let key = signing_key(1);
        let no_kid = sign(&json!({"alg": "EdDSA"}), &c, &key);
        assert!(matches!(verify(&no_kid), Err(Error::MissingKid)));
        let unknown = sign(&json!({"alg": "EdDSA", "kid": "k9"}), &c, &key);
        assert!(matches!(verify(&unknown), Err(Error::UnknownKid(k)) if k == "k9"));
        let crit = sign(
            &json!({"alg": "EdDSA", "kid": "k1", "crit": ["b64"], "b64": false}),
            &c,
            &key,
        );
        assert!(matches!(verify(&crit), Err(Error::Critical)));
        let other_key = sign(&json!({"alg": "EdDSA", "kid": "k1"}), &c, &signing_key(2));
        assert!(matches!(verify(&other_key), Err(Error::Signature)));
        for bad in ["", "a.b", "a.b.c.d", "!!.e30.AA"] {
            assert!(matches!(verify(bad), Err(Error::Malformed(_))), "{bad}");
        }
        let huge = "a".repeat(MAX_TOKEN_BYTES + 1);
        assert!(matches!(verify(&huge), Err(Error::TooLarge { .. })));
    }

    #[test]
    fn tampered_payload_is_refused() {
        let token = good(&claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60));
        let parts: Vec<&str> = token.split('.').collect();
        let forged = b64(&json!({"iss": ISS, "aud": SUPERVISOR_AUDIENCE, "sub": "pool:evil",
            "iat": now_s(), "exp": now_s() + 60, "jti": "j1"}));
        let tampered = format!("{}.{forged}.{}", parts[0], parts[2]);
        assert!(matches!(verify(&tampered), Err(Error::Signature)));
    }

    #[test]
    fn audience_issuer_type_and_lifetime_are_checked() {
        let key = signing_key(1);
        let c = claims(INSTANCE_AUDIENCE, now_s(), now_s() + 60);
        assert!(matches!(verify(&good(&c)), Err(Error::Audience { .. })));
        let mut c = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60);
        c["iss"] = json!("someone-else");
        assert!(matches!(verify(&good(&c)), Err(Error::Issuer { .. })));
        c["iss"] = json!(ISS);
        c["aud"] = json!([SUPERVISOR_AUDIENCE]);
        assert!(
            matches!(verify(&good(&c)), Err(Error::Audience { .. })),
            "arrays are never minted"
        );
        c["aud"] = json!(SUPERVISOR_AUDIENCE);
        let wrong_typ = sign(&json!({"alg": "EdDSA", "kid": "k1", "typ": GRANT_TYP}), &c, &key);
        assert!(matches!(verify(&wrong_typ), Err(Error::Type { .. })));
        let long = claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 3601);
        assert!(matches!(verify(&good(&long)), Err(Error::Lifetime { .. })));
        let no_exp = json!({"iss": ISS, "aud": SUPERVISOR_AUDIENCE, "iat": now_s()});
        assert!(matches!(verify(&good(&no_exp)), Err(Error::Claims(_))));
    }

    #[test]
    fn errors_never_quote_the_token() {
        let c = claims(SUPERVISOR_AUDIENCE, now_s() - 7200, now_s() - 3600);
        let token = good(&c);
        let shown = verify(&token).unwrap_err().to_string();
        for part in token.split('.') {
            assert!(!shown.contains(part), "{shown}");
        }
        let weird = format!("{}.e30.", b64(&json!({"alg": "x".repeat(100)})));
        assert!(verify(&weird).unwrap_err().to_string().contains("(unprintable)"));
    }

    #[test]
    fn jwks_round_trips_and_refuses_bad_sets() {
        let mut b = bundle();
        b.keys.insert("k2".into(), signing_key(2).verifying_key());
        let parsed = TrustBundle::from_jwks(b.to_jwks().as_bytes()).unwrap();
        assert_eq!(parsed, b);

        let x = URL_SAFE_NO_PAD.encode(signing_key(1).verifying_key().as_bytes());
        let set = |keys: Value| json!({"issuer": ISS, "keys": keys}).to_string();
        let ok_key = json!({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "k1"});
        // Other key types are skipped, not fatal.
        let mixed = set(json!([ok_key, {"kty": "EC", "crv": "P-256", "kid": "e", "x": "AA", "y": "AA"}]));
        assert_eq!(TrustBundle::from_jwks(mixed.as_bytes()).unwrap().keys.len(), 1);
        let refused = [
            set(json!([ok_key, ok_key])),
            set(json!([{"kty": "OKP", "crv": "Ed25519", "x": x}])),
            set(json!([{"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "k1", "d": x}])),
            set(json!([{"kty": "OKP", "crv": "Ed25519", "x": "AAAA", "kid": "k1"}])),
            set(json!([])),
            json!({"keys": [ok_key]}).to_string(),
            "not json".into(),
            format!("{}{}", set(json!([ok_key])), " ".repeat(MAX_BUNDLE_BYTES)),
        ];
        for jwks in refused {
            assert!(
                TrustBundle::from_jwks(jwks.as_bytes()).is_err(),
                "{}",
                &jwks[..jwks.len().min(200)]
            );
        }
    }

    #[test]
    fn claims_at_the_i64_edges_never_overflow_the_checks() {
        let max_s = i64::MAX / 1000;
        let cases = [
            // The reported token: `exp - iat` in milliseconds wraps to a negative lifetime.
            (-9_000_000_000_000_000, 9_000_000_000_000_000),
            (-max_s, max_s),
            (i64::MIN, i64::MAX),
            (i64::MIN, now_s() + 60),
            (now_s() - 60, i64::MAX),
            (-1, now_s() + 60),
            (now_s() - 60, -1),
            (now_s() + 60, now_s() - 60),
            (i64::MAX, i64::MIN),
        ];
        for (iat, exp) in cases {
            let refused = verify(&good(&claims(SUPERVISOR_AUDIENCE, iat, exp)));
            assert!(refused.is_err(), "iat {iat}, exp {exp}: {refused:?}");
        }
        let refused = verify(&good(&claims(
            SUPERVISOR_AUDIENCE,
            -9_000_000_000_000_000,
            9_000_000_000_000_000,
        )));
        assert!(matches!(refused, Err(Error::Lifetime { .. })), "{refused:?}");
        // The same edges against a verifier without a lifetime bound.
        let unbounded = Expectation::new(SUPERVISOR_AUDIENCE, ISS);
        for (iat, exp) in cases {
            let token = good(&claims(SUPERVISOR_AUDIENCE, iat, exp));
            let outcome = bundle().verify_at::<Claims>(&token, &unbounded, NOW_MS);
            let reasonable = (0..=now_s()).contains(&iat) && exp > now_s() && exp <= max_s;
            assert_eq!(outcome.is_ok(), reasonable, "iat {iat}, exp {exp}: {outcome:?}");
        }
        // And at the edges of the verifier's clock.
        for now in [i64::MIN, i64::MAX, -1] {
            let token = good(&claims(SUPERVISOR_AUDIENCE, now_s(), now_s() + 60));
            let at = bundle().verify_at::<Claims>(&token, &Expectation::kind(Kind::Supervisor, ISS), now);
            assert!(at.is_err(), "now {now}: {at:?}");
        }
    }

    #[test]
    fn kinds_bound_lifetimes_below_key_retention() {
        for kind in Kind::ALL {
            assert!(kind.max_lifetime() <= SUPERVISOR_TOKEN_LIFETIME, "{kind:?}");
        }
        assert_eq!(route_of(&instance_subject("team-a/web-0")), Some("team-a/web-0"));
        assert_eq!(route_of("member:m"), None);
        assert_eq!(member_of(&member_subject("supervisor-0")), Some("supervisor-0"));
        assert_eq!(member_of("instance:a/b"), None);
        assert_eq!(member_of("member:"), None);
    }
}
