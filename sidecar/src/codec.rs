//! Serde adapters for the persisted state: bytes as base64url, protobuf messages as their
//! base64url-encoded wire form, and the workload identity.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use proto::common::v1::WorkloadIdentity;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `Vec<u8>` as a base64url string.
pub mod b64 {
    use super::*;

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&URL_SAFE_NO_PAD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| serde::de::Error::custom("not base64url"))
    }
}

/// A prost message as the base64url of its encoding.
pub mod message {
    use super::*;

    pub fn serialize<M: prost::Message, S: Serializer>(message: &M, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&URL_SAFE_NO_PAD.encode(message.encode_to_vec()))
    }

    pub fn deserialize<'de, M: prost::Message + Default, D: Deserializer<'de>>(d: D) -> Result<M, D::Error> {
        let bytes = super::b64::deserialize(d)?;
        M::decode(bytes.as_slice()).map_err(|_| serde::de::Error::custom("not a valid message"))
    }
}

/// `common.v1.WorkloadIdentity` in the state file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub pid: u32,
    pub start_time_ticks: u64,
    #[serde(with = "b64")]
    pub exe_digest: Vec<u8>,
}

impl From<&WorkloadIdentity> for Identity {
    fn from(id: &WorkloadIdentity) -> Self {
        Self {
            pid: id.pid,
            start_time_ticks: id.start_time_ticks,
            exe_digest: id.exe_digest.clone(),
        }
    }
}

impl From<Identity> for WorkloadIdentity {
    fn from(id: Identity) -> Self {
        Self {
            pid: id.pid,
            start_time_ticks: id.start_time_ticks,
            exe_digest: id.exe_digest,
        }
    }
}
