//! The [`Keyring`]: the store's signing keys in memory. Mints tokens with the signer (see
//! [`rotation::signer`](super::rotation::signer)), publishes every stored public key as the
//! trust bundle, and verifies through [`proto::trust`]. Every replica loads it from the store
//! and reloads it more often than [`Policy::publish_ahead`](super::Policy::publish_ahead).

use std::fmt;
use std::time::{Duration, SystemTime};

use ed25519_dalek::pkcs8::EncodePrivateKey;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use proto::trust::{self, Claims, Expectation, Kind, TrustBundle};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use super::keys::{self, KeyPair};
use super::{Error, needs_renewal, rotation};
use crate::store::sealing::Keks;
use crate::store::{SigningKey, Store};

/// Registered claim names an extra claim may not use.
const RESERVED: [&str; 7] = ["iss", "aud", "sub", "iat", "exp", "nbf", "jti"];

/// Signing keys of the gateway, loaded from the store.
pub struct Keyring {
    issuer: String,
    signer: Option<(String, EncodingKey)>,
    bundle: TrustBundle,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("issuer", &self.issuer)
            .field("signer", &self.signing_kid())
            .field("published", &self.bundle.keys.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A minted token. `Debug` does not show the token.
#[derive(Clone, PartialEq, Eq)]
pub struct Minted {
    pub token: String,
    pub kind: Kind,
    pub kid: String,
    pub jti: String,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
}

impl Minted {
    /// From half its lifetime on: see [`needs_renewal`].
    pub fn needs_renewal(&self, now_ms: i64) -> bool {
        needs_renewal(self.issued_at_ms, self.expires_at_ms, now_ms)
    }
}

impl fmt::Debug for Minted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Minted")
            .field("token", &"<redacted>")
            .field("kind", &self.kind)
            .field("kid", &self.kid)
            .field("jti", &self.jti)
            .field("issued_at_ms", &self.issued_at_ms)
            .field("expires_at_ms", &self.expires_at_ms)
            .finish()
    }
}

impl Keyring {
    /// Load every stored key, the signer's opened with the store's key-encryption keys
    /// ([`Store::keks`]). An empty store gives a keyring that cannot mint yet.
    pub async fn load(store: &Store, issuer: &str) -> Result<Self, Error> {
        Self::from_records(issuer, &store.list_signing_keys().await?, store.keks())
    }

    /// A keyring with no keys yet: verifies nothing, mints nothing.
    pub fn empty(issuer: &str) -> Self {
        Self {
            issuer: issuer.to_owned(),
            signer: None,
            bundle: TrustBundle::new(issuer),
        }
    }

    /// A keyring of `records`: all of them published, the signer's private key opened with
    /// `keks`.
    pub fn from_records(issuer: &str, records: &[SigningKey], keks: Option<&Keks>) -> Result<Self, Error> {
        let mut bundle = TrustBundle::new(issuer);
        for record in records {
            bundle.keys.insert(record.kid.clone(), keys::public_key(record)?);
        }
        let signer = match rotation::signer(records) {
            Some(record) => {
                let pair = KeyPair::from_record(record, keks)?;
                let der = pair.secret().to_pkcs8_der().map_err(|_| Error::Key {
                    kid: record.kid.clone(),
                    reason: "cannot encode the private key",
                })?;
                Some((record.kid.clone(), EncodingKey::from_ed_der(der.as_bytes())))
            }
            None => None,
        };
        Ok(Self {
            issuer: issuer.to_owned(),
            signer,
            bundle,
        })
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The `kid` new tokens carry, if there is a key yet.
    pub fn signing_kid(&self) -> Option<&str> {
        self.signer.as_ref().map(|(kid, _)| kid.as_str())
    }

    /// Every stored public key (pending, signing and retired) with the issuer.
    pub fn trust_bundle(&self) -> &TrustBundle {
        &self.bundle
    }

    /// Mint a `kind` token for `subject`, valid for `lifetime` (whole seconds, at most the
    /// kind's [`Kind::max_lifetime`]) from now. `extra` must serialize to a JSON object (or
    /// unit) without registered claim names, e.g. [`trust::OperatorClaims`].
    pub fn mint<E: Serialize>(
        &self,
        kind: Kind,
        subject: &str,
        lifetime: Duration,
        extra: &E,
    ) -> Result<Minted, Error> {
        self.mint_at(kind, subject, lifetime, extra, trust::unix_ms(SystemTime::now()))
    }

    /// [`mint`](Self::mint) at `now_ms` (Unix milliseconds).
    pub fn mint_at<E: Serialize>(
        &self,
        kind: Kind,
        subject: &str,
        lifetime: Duration,
        extra: &E,
        now_ms: i64,
    ) -> Result<Minted, Error> {
        let (kid, key) = self.signer.as_ref().ok_or(Error::NoSigningKey)?;
        if lifetime < Duration::from_secs(1) || lifetime > kind.max_lifetime() {
            return Err(Error::Lifetime {
                kind,
                lifetime,
                max: kind.max_lifetime(),
            });
        }
        let mut claims = match serde_json::to_value(extra).map_err(|_| Error::Extra("not serializable".into()))? {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            _ => return Err(Error::Extra("not a JSON object".into())),
        };
        if let Some(name) = RESERVED.iter().find(|name| claims.contains_key(**name)) {
            return Err(Error::Extra(format!("uses the registered claim name {name}")));
        }
        let iat = now_ms.div_euclid(1000);
        let exp = iat.saturating_add(i64::try_from(lifetime.as_secs()).unwrap_or(i64::MAX));
        let jti = uuid::Uuid::new_v4().to_string();
        for (name, value) in [
            ("iss", json!(self.issuer)),
            ("aud", json!(kind.audience())),
            ("sub", json!(subject)),
            ("iat", json!(iat)),
            ("exp", json!(exp)),
            ("jti", json!(jti)),
        ] {
            claims.insert(name.to_owned(), value);
        }
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(kid.clone());
        header.typ = Some(kind.typ().to_owned());
        let token = jsonwebtoken::encode(&header, &claims, key)?;
        if token.len() > trust::MAX_TOKEN_BYTES {
            return Err(Error::Extra(format!(
                "make the token longer than the {} bytes verifiers accept",
                trust::MAX_TOKEN_BYTES
            )));
        }
        Ok(Minted {
            token,
            kind,
            kid: kid.clone(),
            jti,
            issued_at_ms: iat.saturating_mul(1000),
            expires_at_ms: exp.saturating_mul(1000),
        })
    }

    /// Verify a `kind` token of this gateway (issuer, audience, `typ`, lifetime) now.
    pub fn verify<E: DeserializeOwned>(&self, kind: Kind, token: &str) -> Result<Claims<E>, trust::Error> {
        self.verify_at(kind, token, trust::unix_ms(SystemTime::now()))
    }

    /// [`verify`](Self::verify) at `now_ms` (Unix milliseconds).
    pub fn verify_at<E: DeserializeOwned>(
        &self,
        kind: Kind,
        token: &str,
        now_ms: i64,
    ) -> Result<Claims<E>, trust::Error> {
        self.bundle
            .verify_at(token, &Expectation::kind(kind, &self.issuer), now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sealing::Kek;
    use trust::{NoExtra, OperatorClaims};

    const NOW: i64 = 1_700_000_000_123;

    fn keks() -> Keks {
        Keks::new(Kek::generate().unwrap(), None)
    }

    fn keyring() -> Keyring {
        let keks = keks();
        let record = KeyPair::generate().unwrap().to_record(keks.current()).unwrap();
        Keyring::from_records(trust::DEFAULT_ISSUER, &[record], Some(&keks)).unwrap()
    }

    #[test]
    fn mints_with_header_and_registered_claims() {
        let ring = keyring();
        let roles = OperatorClaims {
            roles: vec!["platform_admin".into()],
        };
        let minted = ring
            .mint_at(Kind::Operator, "alice", Duration::from_secs(600), &roles, NOW)
            .unwrap();
        assert_eq!(
            (minted.issued_at_ms, minted.expires_at_ms),
            (NOW - 123, NOW - 123 + 600_000)
        );
        let header = jsonwebtoken::decode_header(&minted.token).unwrap();
        assert_eq!(header.kid.as_deref(), ring.signing_kid());
        assert_eq!(header.typ.as_deref(), Some("JWT"));
        let claims: Claims<OperatorClaims> = ring.verify_at(Kind::Operator, &minted.token, NOW).unwrap();
        assert_eq!((claims.sub.as_str(), claims.extra), ("alice", roles));
        assert_eq!(claims.jti, minted.jti);
        // An operator token is not a supervisor token.
        assert!(ring.verify_at::<NoExtra>(Kind::Supervisor, &minted.token, NOW).is_err());
    }

    #[test]
    fn refuses_bad_lifetimes_reserved_extras_and_an_empty_ring() {
        let ring = keyring();
        let grant = ring.mint_at(Kind::RecoveryGrant, "r", Duration::from_secs(31), &NoExtra {}, NOW);
        assert!(matches!(grant, Err(Error::Lifetime { .. })));
        let zero = ring.mint_at(Kind::Supervisor, "p", Duration::from_millis(999), &NoExtra {}, NOW);
        assert!(matches!(zero, Err(Error::Lifetime { .. })));
        let sneaky = json!({"aud": "openshell-operator"});
        let minted = ring.mint_at(Kind::Supervisor, "p", Duration::from_secs(60), &sneaky, NOW);
        assert!(matches!(minted, Err(Error::Extra(_))));
        let huge = json!({"pad": "x".repeat(trust::MAX_TOKEN_BYTES)});
        let minted = ring.mint_at(Kind::Supervisor, "p", Duration::from_secs(60), &huge, NOW);
        assert!(matches!(minted, Err(Error::Extra(_))));
        let empty = Keyring::from_records("gw", &[], None).unwrap();
        assert!(matches!(
            empty.mint_at(Kind::Supervisor, "p", Duration::from_secs(60), &(), NOW),
            Err(Error::NoSigningKey)
        ));
    }

    #[test]
    fn debug_shows_no_key_material_or_token() {
        let keks = keks();
        let pair = KeyPair::generate().unwrap();
        let record = pair.to_record(keks.current()).unwrap();
        let ring = Keyring::from_records("gw", std::slice::from_ref(&record), Some(&keks)).unwrap();
        let minted = ring
            .mint_at(Kind::Supervisor, "pool:p", Duration::from_secs(60), &(), NOW)
            .unwrap();
        let pem = pair
            .secret()
            .to_pkcs8_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
            .unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let shown = format!("{ring:?} {minted:?}");
        assert!(!shown.contains(&body), "{shown}");
        assert!(!shown.contains(&minted.token), "{shown}");
        assert!(shown.contains(&record.kid));
    }
}
