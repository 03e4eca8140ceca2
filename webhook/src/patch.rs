//! The RFC 6902 JSON Patch of an injection, written straight as JSON text.
//!
//! The constant values of the patch (the sidecar container, the volumes, the workload env and
//! mount) are serialized once at start ([`Fragment`]) and copied into each patch as text:
//! per request nothing is cloned as a `serde_json::Value` tree and serialized again. Pointer
//! tokens are escaped by `jsonptr` (the crate `json-patch` builds on).

use std::borrow::Cow;
use std::fmt;
use std::io::Write as _;

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// Escape one JSON Pointer reference token (RFC 6901): `~` becomes `~0`, `/` becomes `~1`.
pub fn escape_pointer_token(token: &str) -> Cow<'_, str> {
    json_patch::jsonptr::Token::new(token).into_encoded()
}

/// A constant JSON value: kept as a `Value` (for callers that inspect it) and as its
/// serialized text (what patches copy).
#[derive(Clone, Debug)]
pub struct Fragment {
    value: Value,
    json: String,
}

impl Fragment {
    pub fn new(value: Value) -> Self {
        // A `Value` always serializes (its map keys are strings).
        let json = serde_json::to_string(&value).unwrap_or_else(|_| "null".into());
        Self { value, json }
    }

    pub fn value(&self) -> &Value {
        &self.value
    }

    pub fn json(&self) -> &str {
        &self.json
    }
}

/// A finished JSON Patch: the JSON text of an array of operations.
#[derive(Clone, PartialEq, Eq)]
pub struct JsonPatch(Vec<u8>);

impl JsonPatch {
    /// The patch as JSON text (what the AdmissionResponse carries, base64-encoded).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for JsonPatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.0))
    }
}

/// Serializes as the array of operations it holds.
impl Serialize for JsonPatch {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let raw: &RawValue = serde_json::from_slice(&self.0).map_err(serde::ser::Error::custom)?;
        raw.serialize(serializer)
    }
}

/// Writes `add` operations (the only kind the webhook emits) into one patch.
#[derive(Debug)]
pub struct PatchWriter {
    out: Vec<u8>,
    path: String,
    empty: bool,
}

impl PatchWriter {
    pub fn with_capacity(bytes: usize) -> Self {
        let mut out = Vec::with_capacity(bytes);
        out.push(b'[');
        Self {
            out,
            path: String::with_capacity(64),
            empty: true,
        }
    }

    /// Starts an `add` at `path` (escaped as a JSON string); the caller writes the value.
    fn begin(&mut self, path: fmt::Arguments<'_>) {
        if !self.empty {
            self.out.push(b',');
        }
        self.empty = false;
        self.path.clear();
        // Writing into a String cannot fail.
        let _ = fmt::Write::write_fmt(&mut self.path, path);
        self.out.extend_from_slice(br#"{"op":"add","path":"#);
        // Serializing a str into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut self.out, self.path.as_str());
        self.out.extend_from_slice(br#","value":"#);
    }

    /// `add` at `path` of a value given as JSON text.
    pub fn add_json(&mut self, path: fmt::Arguments<'_>, json: &str) {
        self.begin(path);
        self.out.extend_from_slice(json.as_bytes());
        self.out.push(b'}');
    }

    /// `add` at `path` of a value serialized now.
    pub fn add_value(&mut self, path: fmt::Arguments<'_>, value: &impl Serialize) {
        self.begin(path);
        if serde_json::to_writer(&mut self.out, value).is_err() {
            self.out.extend_from_slice(b"null");
        }
        self.out.push(b'}');
    }

    /// `add` at `path` of an array of values given as JSON text.
    pub fn add_array<'a>(&mut self, path: fmt::Arguments<'_>, items: impl IntoIterator<Item = &'a str>) {
        self.begin(path);
        self.out.push(b'[');
        for (index, item) in items.into_iter().enumerate() {
            if index > 0 {
                self.out.push(b',');
            }
            self.out.extend_from_slice(item.as_bytes());
        }
        self.out.extend_from_slice(b"]}");
    }

    /// Appends each item to the array at `path` (`path/-`), or creates the array with one
    /// `add` when it is missing.
    pub fn push_all(&mut self, path: fmt::Arguments<'_>, exists: bool, items: &[&str]) {
        if items.is_empty() {
            return;
        }
        if exists {
            for item in items {
                self.add_json(format_args!("{path}/-"), item);
            }
        } else {
            self.add_array(path, items.iter().copied());
        }
    }

    pub fn is_empty(&self) -> bool {
        self.empty
    }

    pub fn finish(mut self) -> JsonPatch {
        // `write_all` into a Vec cannot fail.
        let _ = self.out.write_all(b"]");
        JsonPatch(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_order_is_tilde_then_slash() {
        assert_eq!(
            escape_pointer_token("supervision.openshell.ai/injected"),
            "supervision.openshell.ai~1injected"
        );
        // `~` first: `a~/b` must become `a~0~1b`, not `a~01b` (slash first would give that).
        assert_eq!(escape_pointer_token("a~/b"), "a~0~1b");
        assert_eq!(escape_pointer_token("~1"), "~01");
        assert_eq!(escape_pointer_token("plain"), "plain");
    }

    #[test]
    fn writes_a_patch_that_parses_and_escapes_paths() {
        let mut patch = PatchWriter::with_capacity(64);
        patch.add_json(format_args!("/a/{}", escape_pointer_token("b\"/c")), r#"{"x":1}"#);
        patch.push_all(format_args!("/list"), true, &["1", "2"]);
        patch.push_all(format_args!("/new"), false, &["1", "2"]);
        patch.add_value(format_args!("/s"), &"text");
        let value = serde_json::to_value(patch.finish()).unwrap_or_default();
        assert_eq!(
            value,
            serde_json::json!([
                { "op": "add", "path": "/a/b\"~1c", "value": { "x": 1 } },
                { "op": "add", "path": "/list/-", "value": 1 },
                { "op": "add", "path": "/list/-", "value": 2 },
                { "op": "add", "path": "/new", "value": [1, 2] },
                { "op": "add", "path": "/s", "value": "text" },
            ])
        );
    }
}
