//! Ed25519 key pairs: generation, PEM encoding, and conversion from and to the store's
//! [`SigningKey`] record. The private half lives in `ed25519_dalek::SigningKey` (zeroized on
//! drop) and in the record's [`SecretBytes`]; neither is ever printed.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{SigningKey as Secret, VerifyingKey};
use rand::TryRngCore;
use rand::rngs::OsRng;

use super::Error;
use crate::store::{SecretBytes, SigningKey};

/// The `algorithm` column of every key this gateway creates.
pub const ALGORITHM: &str = proto::trust::ALGORITHM;

/// One signing key in memory: its `kid` and the Ed25519 secret.
pub struct KeyPair {
    kid: String,
    secret: Secret,
}

impl KeyPair {
    /// A new key from the operating system's random source; `kid` is a random UUID.
    pub fn generate() -> Result<Self, Error> {
        let mut seed = [0u8; 32];
        OsRng
            .try_fill_bytes(&mut seed)
            .map_err(|e| Error::Random(e.to_string()))?;
        let secret = Secret::from_bytes(&seed);
        seed.fill(0);
        Ok(Self {
            kid: uuid::Uuid::new_v4().simple().to_string(),
            secret,
        })
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    pub fn public_key(&self) -> VerifyingKey {
        self.secret.verifying_key()
    }

    pub(crate) fn secret(&self) -> &Secret {
        &self.secret
    }

    /// The record to store: PEM (PKCS#8 private, SPKI public), not retired. `created_at_ms`
    /// is left 0: the store stamps it from the database clock.
    pub fn to_record(&self) -> Result<SigningKey, Error> {
        let private_pem = self
            .secret
            .to_pkcs8_pem(LineEnding::LF)
            .map_err(|_| self.key_error("cannot encode the private key"))?;
        let public_pem = self
            .public_key()
            .to_public_key_pem(LineEnding::LF)
            .map_err(|_| self.key_error("cannot encode the public key"))?;
        Ok(SigningKey {
            kid: self.kid.clone(),
            algorithm: ALGORITHM.to_owned(),
            public_pem,
            private_pem: SecretBytes(private_pem.as_bytes().to_vec()),
            created_at_ms: 0,
            retired_at_ms: None,
        })
    }

    /// The key pair of a stored record; its private key must match its public key.
    pub fn from_record(record: &SigningKey) -> Result<Self, Error> {
        let public = public_key(record)?;
        let pem =
            std::str::from_utf8(&record.private_pem.0).map_err(|_| key_error(record, "private key is not PEM"))?;
        let secret = Secret::from_pkcs8_pem(pem).map_err(|_| key_error(record, "private key is not PKCS#8 Ed25519"))?;
        if secret.verifying_key() != public {
            return Err(key_error(record, "private key does not match the public key"));
        }
        Ok(Self {
            kid: record.kid.clone(),
            secret,
        })
    }

    fn key_error(&self, reason: &'static str) -> Error {
        Error::Key {
            kid: self.kid.clone(),
            reason,
        }
    }
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPair")
            .field("kid", &self.kid)
            .field("public", &URL_SAFE_NO_PAD.encode(self.public_key().as_bytes()))
            .finish_non_exhaustive()
    }
}

/// The public key of a stored record (algorithm EdDSA, SPKI PEM).
pub fn public_key(record: &SigningKey) -> Result<VerifyingKey, Error> {
    if record.algorithm != ALGORITHM {
        return Err(key_error(record, "algorithm is not EdDSA"));
    }
    VerifyingKey::from_public_key_pem(&record.public_pem)
        .map_err(|_| key_error(record, "public key is not SPKI Ed25519"))
}

fn key_error(record: &SigningKey, reason: &'static str) -> Error {
    Error::Key {
        kid: record.kid.clone(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_mismatches_are_refused() {
        let pair = KeyPair::generate().unwrap();
        let record = pair.to_record().unwrap();
        assert!(record.public_pem.starts_with("-----BEGIN PUBLIC KEY-----"));
        assert_eq!(record.kid.len(), 32);
        let back = KeyPair::from_record(&record).unwrap();
        assert_eq!((back.kid(), back.public_key()), (pair.kid(), pair.public_key()));

        let other = KeyPair::generate().unwrap().to_record().unwrap();
        let mixed = SigningKey {
            public_pem: other.public_pem,
            ..record.clone()
        };
        assert!(matches!(KeyPair::from_record(&mixed), Err(Error::Key { .. })));
        let wrong_alg = SigningKey {
            algorithm: "ES256".into(),
            ..record
        };
        assert!(matches!(public_key(&wrong_alg), Err(Error::Key { .. })));
    }

    #[test]
    fn debug_never_shows_the_private_key() {
        let pair = KeyPair::generate().unwrap();
        let record = pair.to_record().unwrap();
        let pem = String::from_utf8(record.private_pem.0.clone()).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let seed = URL_SAFE_NO_PAD.encode(pair.secret().to_bytes());
        for shown in [format!("{pair:?}"), format!("{record:?}")] {
            assert!(!shown.contains(&body) && !shown.contains(&seed), "{shown}");
        }
    }
}
