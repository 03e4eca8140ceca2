//! Ed25519 key pairs: generation, PEM encoding, and conversion from and to the store's
//! [`SigningKey`] record, whose private key is sealed with a key-encryption key (see
//! [`sealing`](super::sealing)). The private half lives in `ed25519_dalek::SigningKey`
//! (zeroized on drop) and, sealed, in the record's [`SecretBytes`]; neither is ever printed.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{SigningKey as Secret, VerifyingKey};
use rand::TryRngCore;
use rand::rngs::OsRng;

use super::Error;
use crate::store::sealing::{self, Kek, Keks};
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

    /// The record to store: SPKI PEM public key, PKCS#8 PEM private key sealed with `kek`,
    /// not retired. `created_at_ms` is left 0: the store stamps it from the database clock.
    pub fn to_record(&self, kek: &Kek) -> Result<SigningKey, Error> {
        let private_pem = self
            .secret
            .to_pkcs8_pem(LineEnding::LF)
            .map_err(|_| self.key_error("cannot encode the private key"))?;
        let public_pem = self
            .public_key()
            .to_public_key_pem(LineEnding::LF)
            .map_err(|_| self.key_error("cannot encode the public key"))?;
        let record = SigningKey {
            kid: self.kid.clone(),
            algorithm: ALGORITHM.to_owned(),
            public_pem,
            private_pem: SecretBytes::default(),
            created_at_ms: 0,
            retired_at_ms: None,
        };
        Ok(SigningKey {
            private_pem: sealing::seal(kek, &record, private_pem.as_bytes())?,
            ..record
        })
    }

    /// The key pair of a stored record, its private key opened with `keks` (a row an older
    /// gateway stored unsealed opens without); it must match the public key.
    pub fn from_record(record: &SigningKey, keks: Option<&Keks>) -> Result<Self, Error> {
        let public = public_key(record)?;
        let opened = sealing::open(keks, record)?;
        let pem = std::str::from_utf8(&opened).map_err(|_| key_error(record, "private key is not PEM"))?;
        let secret = Secret::from_pkcs8_pem(pem).map_err(|_| key_error(record, "private key is not PKCS#8 Ed25519"))?;
        if secret.verifying_key() != public {
            return Err(key_error(record, "private key does not match the public key"));
        }
        Ok(Self {
            kid: record.kid.clone(),
            secret,
        })
    }

    /// `record` sealed with `keks`' current KEK, after checking it opens to a key that matches
    /// its public key. For rows still sealed with the previous KEK, or stored unsealed.
    pub fn reseal(record: &SigningKey, keks: &Keks) -> Result<SigningKey, Error> {
        Self::from_record(record, Some(keks))?;
        let pem = sealing::open(Some(keks), record)?;
        Ok(SigningKey {
            private_pem: sealing::seal(keks.current(), record, &pem)?,
            ..record.clone()
        })
    }

    /// The same key under another `kid` (tests name their keys).
    #[cfg(test)]
    pub(super) fn with_kid(self, kid: &str) -> Self {
        Self {
            kid: kid.to_owned(),
            ..self
        }
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

    fn keks() -> Keks {
        Keks::new(Kek::generate().unwrap(), None)
    }

    #[test]
    fn records_round_trip_and_mismatches_are_refused() {
        let keks = keks();
        let pair = KeyPair::generate().unwrap();
        let record = pair.to_record(keks.current()).unwrap();
        assert!(record.public_pem.starts_with("-----BEGIN PUBLIC KEY-----"));
        assert_eq!(record.kid.len(), 32);
        assert_eq!(sealing::sealed_with(&record), Some(keks.current().id()));
        let back = KeyPair::from_record(&record, Some(&keks)).unwrap();
        assert_eq!((back.kid(), back.public_key()), (pair.kid(), pair.public_key()));

        // A plain PEM row (an older gateway's) opens, and reseals under the current KEK.
        let pem = pair.secret().to_pkcs8_pem(LineEnding::LF).unwrap();
        let plain = SigningKey {
            private_pem: SecretBytes(pem.as_bytes().to_vec()),
            ..record.clone()
        };
        assert_eq!(
            KeyPair::from_record(&plain, None).unwrap().public_key(),
            pair.public_key()
        );
        let resealed = KeyPair::reseal(&plain, &keks).unwrap();
        assert_eq!(sealing::sealed_with(&resealed), Some(keks.current().id()));
        assert_eq!(
            KeyPair::from_record(&resealed, Some(&keks)).unwrap().public_key(),
            pair.public_key()
        );

        // A row with another row's public key is bound to it: it no longer opens.
        let other = KeyPair::generate().unwrap().to_record(keks.current()).unwrap();
        let mixed = SigningKey {
            public_pem: other.public_pem,
            ..record.clone()
        };
        assert!(KeyPair::from_record(&mixed, Some(&keks)).is_err());
        let mixed_plain = SigningKey {
            public_pem: mixed.public_pem.clone(),
            ..plain
        };
        assert!(matches!(
            KeyPair::from_record(&mixed_plain, None),
            Err(Error::Key { .. })
        ));
        let wrong_alg = SigningKey {
            algorithm: "ES256".into(),
            ..record
        };
        assert!(matches!(public_key(&wrong_alg), Err(Error::Key { .. })));
    }

    #[test]
    fn debug_never_shows_the_private_key() {
        let keks = keks();
        let pair = KeyPair::generate().unwrap();
        let record = pair.to_record(keks.current()).unwrap();
        let pem = pair.secret().to_pkcs8_pem(LineEnding::LF).unwrap();
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let seed = URL_SAFE_NO_PAD.encode(pair.secret().to_bytes());
        let sealed = String::from_utf8(record.private_pem.0.clone()).unwrap();
        for shown in [format!("{pair:?}"), format!("{record:?}"), format!("{keks:?}")] {
            assert!(!shown.contains(&sealed), "{shown}");
            assert!(!shown.contains(&body) && !shown.contains(&seed), "{shown}");
        }
    }
}
