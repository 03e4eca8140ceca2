//! The receipt key and the receipt MAC (recovery.proto, `Receipt`): HMAC-SHA256 with the
//! instance's receipt key over `Receipt::mac_input()`. The key is a secret shared only with the
//! gateway (inside the registration material): never logged, never in `Debug`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use proto::recovery::v1::Receipt;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// Length of the receipt key the sidecar generates.
pub const RECEIPT_KEY_BYTES: usize = 32;

#[derive(Clone, PartialEq, Eq)]
pub struct ReceiptKey([u8; RECEIPT_KEY_BYTES]);

impl std::fmt::Debug for ReceiptKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReceiptKey(<redacted>)")
    }
}

impl ReceiptKey {
    /// A fresh key of 32 random bytes.
    pub fn generate() -> Self {
        Self(rand::random())
    }

    pub fn from_bytes(bytes: [u8; RECEIPT_KEY_BYTES]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Sets `receipt.mac` over the receipt's canonical bytes.
    pub fn seal(&self, receipt: &mut Receipt) {
        receipt.mac = self.mac(&receipt.mac_input());
    }

    /// True when `receipt.mac` verifies with this key (constant-time comparison).
    pub fn verifies(&self, receipt: &Receipt) -> bool {
        match Hmac::<Sha256>::new_from_slice(&self.0) {
            Ok(mut mac) => {
                mac.update(&receipt.mac_input());
                mac.verify_slice(&receipt.mac).is_ok()
            }
            Err(_) => false,
        }
    }

    fn mac(&self, input: &[u8]) -> Vec<u8> {
        // HMAC accepts keys of any length: the error branch cannot happen.
        match Hmac::<Sha256>::new_from_slice(&self.0) {
            Ok(mut mac) => {
                mac.update(input);
                mac.finalize().into_bytes().to_vec()
            }
            Err(_) => Vec::new(),
        }
    }
}

impl Serialize for ReceiptKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&URL_SAFE_NO_PAD.encode(self.0))
    }
}

impl<'de> Deserialize<'de> for ReceiptKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let bytes = URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| serde::de::Error::custom("receipt key is not base64url"))?;
        let key = <[u8; RECEIPT_KEY_BYTES]>::try_from(bytes.as_slice())
            .map_err(|_| serde::de::Error::custom("receipt key has the wrong length"))?;
        Ok(Self(key))
    }
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    Sha256::digest(bytes).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_verifies_and_tampering_breaks_it() {
        let key = ReceiptKey::generate();
        let mut receipt = Receipt {
            route: "team-a/agent".into(),
            term: 3,
            grant_id: "g".into(),
            ..Receipt::default()
        };
        key.seal(&mut receipt);
        assert_eq!(receipt.mac.len(), 32);
        assert!(key.verifies(&receipt));
        assert!(!ReceiptKey::generate().verifies(&receipt));
        receipt.term = 4;
        assert!(!key.verifies(&receipt));
    }

    #[test]
    fn debug_and_errors_hide_the_key_and_serde_round_trips() {
        let key = ReceiptKey::from_bytes([9; 32]);
        let encoded = serde_json::to_string(&key).unwrap();
        assert!(!format!("{key:?}").contains(encoded.trim_matches('"')));
        assert_eq!(serde_json::from_str::<ReceiptKey>(&encoded).unwrap(), key);
        assert!(serde_json::from_str::<ReceiptKey>("\"AAAA\"").is_err());
    }
}
