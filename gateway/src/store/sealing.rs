//! Signing keys at rest: every private key the store holds is sealed with a key-encryption
//! key ([`Kek`], 32 random bytes read from a file) by XChaCha20-Poly1305, with a fresh random
//! nonce and the row's `kid`, algorithm and public key as associated data (a sealed key
//! moved to another row does not open). A store dump or backup alone cannot mint tokens.
//!
//! A sealed row reads `openshell-sealed-v1.<kek id>.<nonce>.<ciphertext>` (base64url): the
//! KEK id is a short fingerprint of the key, so the coordinator knows which rows to re-seal
//! when the current KEK changes ([`Keks::previous`] still opens them meanwhile). Rows an
//! older gateway wrote as plain PEM still open, and are sealed by the next rotation pass.
//!
//! Every instance's registration material (it holds the receipt key activation checks receipts
//! against) is sealed the same way, bound to its route and Pod UID ([`seal_material`]).
//!
//! Nothing here prints key material: `Debug` shows KEK ids only, errors name kids and ids.

use std::fmt;
use std::fs::{self, OpenOptions, Permissions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::TryRngCore;
use rand::rngs::OsRng;
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::{SecretBytes, SigningKey};

/// Bytes of a key-encryption key.
pub const KEK_BYTES: usize = 32;
/// File name of a KEK the gateway generates beside its embedded store.
pub const GENERATED_KEK_FILE: &str = "key-encryption-key";
/// What a sealed private key starts with.
const PREFIX: &str = "openshell-sealed-v1";
/// Largest KEK file read (base64 of 32 bytes is 44; whitespace allowed).
const MAX_KEK_FILE_BYTES: u64 = 1024;
const NONCE_BYTES: usize = 24;

/// Why a key-encryption key or a sealed key could not be used. Never carries key material.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the key-encryption key file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the key-encryption key file {path} must hold {KEK_BYTES} random bytes in base64: {reason}")]
    Format { path: String, reason: &'static str },
    #[error("cannot write the key-encryption key file {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot generate a key-encryption key or nonce: {0}")]
    Random(String),
    #[error(
        "no key-encryption key is configured (--key-encryption-key-file): signing keys are never stored unencrypted"
    )]
    NoKek,
    #[error(
        "signing key {kid} is sealed with key-encryption key {kek}, which is not configured (current {current}{previous}): \
         give that key as --key-encryption-key-file or --previous-key-encryption-key-file"
    )]
    UnknownKek {
        kid: String,
        kek: String,
        current: String,
        previous: String,
    },
    #[error(
        "signing key {kid} does not open with key-encryption key {kek}: the key file is not the one it was sealed with, \
         or the row was altered"
    )]
    Open { kid: String, kek: String },
    #[error("signing key {kid}: the stored private key is malformed ({reason})")]
    Malformed { kid: String, reason: &'static str },
    #[error("cannot seal signing key {kid}")]
    Seal { kid: String },
    #[error("the registration material of instance {route}: {reason}")]
    Material { route: String, reason: String },
}

/// One key-encryption key and its id (16 hex digits of a SHA-256 of the key).
pub struct Kek {
    id: String,
    key: Zeroizing<[u8; KEK_BYTES]>,
}

impl fmt::Debug for Kek {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kek").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Kek {
    pub fn from_bytes(bytes: [u8; KEK_BYTES]) -> Self {
        let key = Zeroizing::new(bytes);
        let digest = Sha256::new()
            .chain_update(b"openshell key-encryption key id\0")
            .chain_update(key.as_slice())
            .finalize();
        let id = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        Self { id, key }
    }

    /// A new key from the operating system's random source.
    pub fn generate() -> Result<Self, Error> {
        let mut bytes = Zeroizing::new([0u8; KEK_BYTES]);
        OsRng
            .try_fill_bytes(bytes.as_mut_slice())
            .map_err(|e| Error::Random(e.to_string()))?;
        Ok(Self::from_bytes(*bytes))
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Read a KEK file: base64 (standard or URL-safe, padding optional) of 32 bytes, surrounding
    /// whitespace ignored. Blocking: call it off the runtime.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let shown = path.display().to_string();
        let mut text = Zeroizing::new(String::new());
        fs::File::open(path)
            .and_then(|file| file.take(MAX_KEK_FILE_BYTES + 1).read_to_string(&mut text))
            .map_err(|source| Error::Read {
                path: shown.clone(),
                source,
            })?;
        let format = |reason| Error::Format {
            path: shown.clone(),
            reason,
        };
        if text.len() as u64 > MAX_KEK_FILE_BYTES {
            return Err(format("the file is too large"));
        }
        let trimmed = text.trim().trim_end_matches('=');
        let decoded = Zeroizing::new(
            URL_SAFE_NO_PAD
                .decode(trimmed.replace('+', "-").replace('/', "_"))
                .map_err(|_| format("not base64"))?,
        );
        let bytes: [u8; KEK_BYTES] = decoded.as_slice().try_into().map_err(|_| format("not 32 bytes"))?;
        Ok(Self::from_bytes(bytes))
    }

    /// The KEK in `path`, or a new one written there (mode 0600, created atomically: a
    /// concurrent caller reads the same key) when the file does not exist. `true` when it was
    /// created. Blocking: call it off the runtime.
    pub fn load_or_create(path: &Path) -> Result<(Self, bool), Error> {
        if path.exists() {
            return Self::load(path).map(|kek| (kek, false));
        }
        let kek = Self::generate()?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(".{GENERATED_KEK_FILE}.{}.tmp", uuid::Uuid::new_v4().simple()));
        let write_error = |source| Error::Write {
            path: path.display().to_string(),
            source,
        };
        let written = (|| {
            let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
            file.set_permissions(Permissions::from_mode(0o600))?;
            let encoded = Zeroizing::new(STANDARD.encode(kek.key.as_slice()));
            file.write_all(encoded.as_bytes())?;
            file.write_all(b"\n")?;
            file.sync_all()?;
            // A link never replaces: whoever links first made the key everyone uses.
            fs::hard_link(&tmp, path)
        })();
        let _ = fs::remove_file(&tmp);
        match written {
            Ok(()) => Ok((kek, true)),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => Self::load(path).map(|kek| (kek, false)),
            Err(err) => Err(write_error(err)),
        }
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(self.key.as_slice().into())
    }
}

/// The KEKs a gateway holds: the current one seals, both open.
#[derive(Debug)]
pub struct Keks {
    current: Kek,
    previous: Option<Kek>,
}

impl Keks {
    pub fn new(current: Kek, previous: Option<Kek>) -> Self {
        // The same key given twice is just the current key.
        let previous = previous.filter(|p| p.id != current.id);
        Self { current, previous }
    }

    /// Read the current and (optionally) the previous KEK file. Blocking.
    pub fn load(current: &Path, previous: Option<&Path>) -> Result<Self, Error> {
        let previous = previous.map(Kek::load).transpose()?;
        Ok(Self::new(Kek::load(current)?, previous))
    }

    pub fn current(&self) -> &Kek {
        &self.current
    }

    pub fn previous(&self) -> Option<&Kek> {
        self.previous.as_ref()
    }

    fn find(&self, id: &str) -> Option<&Kek> {
        std::iter::once(&self.current)
            .chain(self.previous.as_ref())
            .find(|kek| kek.id == id)
    }
}

/// Where a generated KEK goes beside an SQLite database file.
pub fn generated_path(database_dir: &Path) -> PathBuf {
    database_dir.join(GENERATED_KEK_FILE)
}

/// Seal the private key `pem` of `record` (whose kid, algorithm and public key are bound in)
/// with `kek`.
pub fn seal(kek: &Kek, record: &SigningKey, pem: &[u8]) -> Result<SecretBytes, Error> {
    seal_bound(kek, &associated_data(record), pem)
        .map(|text| SecretBytes(text.into_bytes()))
        .map_err(|err| {
            err.unwrap_or_else(|| Error::Seal {
                kid: record.kid.clone(),
            })
        })
}

/// `msg` sealed with `kek`, `aad` bound in, as a sealed row reads. `Err(None)`: the cipher
/// refused (never in practice).
fn seal_bound(kek: &Kek, aad: &[u8], msg: &[u8]) -> Result<String, Option<Error>> {
    let mut nonce = [0u8; NONCE_BYTES];
    OsRng
        .try_fill_bytes(&mut nonce)
        .map_err(|e| Some(Error::Random(e.to_string())))?;
    let sealed = kek
        .cipher()
        .encrypt(XNonce::from_slice(&nonce), Payload { msg, aad })
        .map_err(|_| None)?;
    Ok(format!(
        "{PREFIX}.{}.{}.{}",
        kek.id,
        URL_SAFE_NO_PAD.encode(nonce),
        URL_SAFE_NO_PAD.encode(sealed)
    ))
}

/// The id of the KEK `record`'s private key is sealed with; `None` for a plain (unsealed) row.
pub fn sealed_with(record: &SigningKey) -> Option<&str> {
    sealed_bytes_with(&record.private_pem.0)
}

fn sealed_bytes_with(bytes: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    text.strip_prefix(PREFIX)?.strip_prefix('.')?.split('.').next()
}

/// Why a sealed value did not open (the caller names what it was).
enum Unopened {
    Malformed(&'static str),
    NoKek,
    UnknownKek {
        kek: String,
        current: String,
        previous: String,
    },
    Open {
        kek: String,
    },
}

/// The private key PEM of `record`: opened with the KEK it names, or as stored for a row an
/// older gateway wrote unsealed.
pub fn open(keks: Option<&Keks>, record: &SigningKey) -> Result<Zeroizing<Vec<u8>>, Error> {
    let bytes = &record.private_pem.0;
    let kid = || record.kid.clone();
    if !bytes.starts_with(PREFIX.as_bytes()) {
        return if bytes.starts_with(b"-----BEGIN") {
            Ok(Zeroizing::new(bytes.clone()))
        } else {
            Err(Error::Malformed {
                kid: kid(),
                reason: "neither sealed nor PEM",
            })
        };
    }
    open_bound(keks, bytes, &associated_data(record)).map_err(|unopened| match unopened {
        Unopened::Malformed(reason) => Error::Malformed { kid: kid(), reason },
        Unopened::NoKek => Error::NoKek,
        Unopened::UnknownKek { kek, current, previous } => Error::UnknownKek {
            kid: kid(),
            kek,
            current,
            previous,
        },
        Unopened::Open { kek } => Error::Open { kid: kid(), kek },
    })
}

/// Open a sealed value (`bytes` starts with the sealed prefix) with `aad` bound in.
fn open_bound(keks: Option<&Keks>, bytes: &[u8], aad: &[u8]) -> Result<Zeroizing<Vec<u8>>, Unopened> {
    let rest = std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| text.strip_prefix(PREFIX))
        .ok_or(Unopened::Malformed("not sealed"))?;
    let mut parts = rest.split('.');
    let (Some(""), Some(id), Some(nonce), Some(sealed), None) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Unopened::Malformed("not four sealed parts"));
    };
    let keks = keks.ok_or(Unopened::NoKek)?;
    let kek = keks.find(id).ok_or_else(|| Unopened::UnknownKek {
        kek: printable(id),
        current: keks.current.id.clone(),
        previous: keks
            .previous
            .as_ref()
            .map_or_else(String::new, |p| format!(", previous {}", p.id)),
    })?;
    let nonce = URL_SAFE_NO_PAD
        .decode(nonce)
        .ok()
        .filter(|n| n.len() == NONCE_BYTES)
        .ok_or(Unopened::Malformed("bad nonce"))?;
    let sealed = URL_SAFE_NO_PAD
        .decode(sealed)
        .map_err(|_| Unopened::Malformed("bad ciphertext"))?;
    kek.cipher()
        .decrypt(XNonce::from_slice(&nonce), Payload { msg: &sealed, aad })
        .map(Zeroizing::new)
        .map_err(|_| Unopened::Open { kek: kek.id.clone() })
}

/// What a sealed registration material is bound to: its row's route and workload (Pod UID).
fn material_data(route: &str, uid: &str) -> Vec<u8> {
    [PREFIX, "instance material", route, uid].join("\0").into_bytes()
}

/// An instance's registration material (which holds its receipt key) sealed with `kek`,
/// bound to its route and Pod UID: a row's material moved to another row does not open.
pub fn seal_material(kek: &Kek, route: &str, uid: &str, material: &[u8]) -> Result<Vec<u8>, Error> {
    seal_bound(kek, &material_data(route, uid), material)
        .map(String::into_bytes)
        .map_err(|err| {
            err.unwrap_or_else(|| Error::Material {
                route: route.to_owned(),
                reason: "cannot seal".into(),
            })
        })
}

/// Whether a stored material is sealed, and with which KEK.
pub fn material_sealed_with(stored: &[u8]) -> Option<&str> {
    sealed_bytes_with(stored)
}

/// A stored registration material as the registry wrote it: opened, or as stored when an older
/// gateway wrote it in clear (it is sealed at the next start, [`crate::store::Store::seal_materials`]).
pub fn open_material(keks: Option<&Keks>, route: &str, uid: &str, stored: &[u8]) -> Result<Zeroizing<Vec<u8>>, Error> {
    if !stored.starts_with(PREFIX.as_bytes()) {
        return Ok(Zeroizing::new(stored.to_vec()));
    }
    open_bound(keks, stored, &material_data(route, uid)).map_err(|unopened| Error::Material {
        route: route.to_owned(),
        reason: match unopened {
            Unopened::Malformed(reason) => reason.to_owned(),
            Unopened::NoKek => "no key-encryption key is configured".to_owned(),
            Unopened::UnknownKek { kek, current, previous } => {
                format!("sealed with key-encryption key {kek}, not configured (current {current}{previous})")
            }
            Unopened::Open { kek } => format!("does not open with key-encryption key {kek}"),
        },
    })
}

fn associated_data(record: &SigningKey) -> Vec<u8> {
    [PREFIX, &record.kid, &record.algorithm, &record.public_pem]
        .join("\0")
        .into_bytes()
}

/// A KEK id from a row, for a message: only when short and hex.
fn printable(id: &str) -> String {
    if id.len() <= 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        id.to_owned()
    } else {
        "(unprintable)".into()
    }
}

#[cfg(test)]
impl Kek {
    /// The same key again (tests hand one key to several `Keks`).
    pub(crate) fn copy_for_test(&self) -> Kek {
        Kek::from_bytes(*self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kid: &str) -> SigningKey {
        SigningKey {
            kid: kid.into(),
            algorithm: "EdDSA".into(),
            public_pem: "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n".into(),
            private_pem: SecretBytes::default(),
            created_at_ms: 0,
            retired_at_ms: None,
        }
    }

    const PEM: &[u8] = b"-----BEGIN PRIVATE KEY-----\nc2VjcmV0IHNlZWQ=\n-----END PRIVATE KEY-----\n";

    #[test]
    fn sealed_keys_open_with_their_kek_only_and_in_their_row_only() {
        let (a, b) = (Kek::generate().unwrap(), Kek::generate().unwrap());
        let (a_id, b_id) = (a.id().to_owned(), b.id().to_owned());
        let sealed = SigningKey {
            private_pem: seal(&a, &record("k1"), PEM).unwrap(),
            ..record("k1")
        };
        assert_eq!(sealed_with(&sealed), Some(a_id.as_str()));
        let text = String::from_utf8(sealed.private_pem.0.clone()).unwrap();
        assert!(!text.contains("BEGIN") && !text.contains("c2VjcmV0"), "{text}");

        let both = Keks::new(b, Some(a));
        assert_eq!(open(Some(&both), &sealed).unwrap().as_slice(), PEM);
        // Another KEK with the same id field cannot exist; a wrong key under this id fails.
        let only_b = Keks::new(both.current.copy_for_test(), None);
        let err = open(Some(&only_b), &sealed).unwrap_err();
        assert!(matches!(err, Error::UnknownKek { .. }), "{err}");
        assert!(
            err.to_string().contains(&a_id) && err.to_string().contains(&b_id),
            "{err}"
        );
        assert!(matches!(open(None, &sealed), Err(Error::NoKek)));
        // Moved to another row: the associated data differs.
        let moved = SigningKey {
            kid: "k2".into(),
            ..sealed.clone()
        };
        assert!(matches!(open(Some(&both), &moved), Err(Error::Open { .. })));
        // Two seals of the same key differ (fresh nonce).
        let again = seal(both.previous().unwrap(), &record("k1"), PEM).unwrap();
        assert_ne!(again, sealed.private_pem);
    }

    #[test]
    fn plain_rows_open_and_garbage_is_refused() {
        let plain = SigningKey {
            private_pem: SecretBytes(PEM.to_vec()),
            ..record("k1")
        };
        assert_eq!(sealed_with(&plain), None);
        assert_eq!(open(None, &plain).unwrap().as_slice(), PEM);
        for bad in [
            &b"junk"[..],
            b"openshell-sealed-v1.x",
            b"openshell-sealed-v1.abcd.AAAA.AAAA",
        ] {
            let row = SigningKey {
                private_pem: SecretBytes(bad.to_vec()),
                ..record("k1")
            };
            let keks = Keks::new(Kek::generate().unwrap(), None);
            assert!(open(Some(&keks), &row).is_err());
        }
    }

    #[test]
    fn kek_files_round_trip_and_bad_ones_are_refused_without_their_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = generated_path(dir.path());
        let (made, created) = Kek::load_or_create(&path).unwrap();
        assert!(created);
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let (again, created) = Kek::load_or_create(&path).unwrap();
        assert!(!created);
        assert_eq!(made.id(), again.id());
        assert_eq!(Kek::load(&path).unwrap().id(), made.id());
        let content = fs::read_to_string(&path).unwrap();
        assert!(!format!("{made:?}").contains(content.trim()));

        let bad = dir.path().join("bad");
        for text in ["c2hvcnQ=", "not base64 at all!", ""] {
            fs::write(&bad, text).unwrap();
            let err = Kek::load(&bad).unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "{err}");
            assert!(text.is_empty() || !err.to_string().contains(text), "{err}");
        }
        assert!(matches!(
            Kek::load(&dir.path().join("missing")),
            Err(Error::Read { .. })
        ));
    }
}
