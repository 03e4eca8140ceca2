//! The fast decode of an AdmissionReview body: a pruned view that keeps exactly the parts
//! [`crate::review::mutate`] and [`crate::inject::Injector::mutate_pod`] read and skips the rest
//! without allocating (`managedFields`, `userInfo`, `options`, `status`, and in the Pod spec
//! everything but the names, env, volume mounts and devices and security contexts of the
//! containers, init containers and ephemeral containers, the volumes, the Pod's security
//! context, the three flags the decision reads and the restart policy the sidecar is told).
//!
//! [`pruned`] returns `None` for anything that does not fit the view (wrong types, duplicate
//! keys, arrays where objects belong); the caller then decodes the whole body as a `Value`, so
//! both paths answer alike (tests check it on every fixture and on odd inputs).

use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

/// Decode `body` into the pruned review, as a `Value` (absent fields stay absent; `null` reads
/// as absent, which the decision treats alike).
pub fn pruned(body: &[u8]) -> Option<Value> {
    serde_json::from_slice::<ReviewIn>(body).ok().map(ReviewIn::into_value)
}

/// First field of every view struct: serde accepts a JSON array in place of a struct (one
/// element per field), which the whole-`Value` path would not read as an object. This field
/// takes the array's first element and refuses it, so such input leaves the fast path. In an
/// object it is absent (a key of this name refuses too).
#[derive(Default)]
struct NotAnArray;

impl<'de> Deserialize<'de> for NotAnArray {
    fn deserialize<D: Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom("an array where an object belongs"))
    }
}

#[derive(Deserialize)]
struct ReviewIn {
    #[serde(rename = "\u{0}", default)]
    _object: NotAnArray,
    #[serde(rename = "apiVersion")]
    api_version: Option<Value>,
    kind: Option<Value>,
    request: Option<RequestIn>,
}

#[derive(Deserialize)]
struct RequestIn {
    #[serde(rename = "\u{0}", default)]
    _object: NotAnArray,
    uid: Option<Value>,
    kind: Option<Value>,
    #[serde(rename = "subResource")]
    sub_resource: Option<Value>,
    operation: Option<Value>,
    namespace: Option<Value>,
    name: Option<Value>,
    #[serde(rename = "dryRun")]
    dry_run: Option<Value>,
    object: Option<ObjectIn>,
}

#[derive(Deserialize)]
struct ObjectIn {
    #[serde(rename = "\u{0}", default)]
    _object: NotAnArray,
    metadata: Option<MetadataIn>,
    spec: Option<SpecIn>,
}

#[derive(Deserialize)]
struct MetadataIn {
    #[serde(rename = "\u{0}", default)]
    _object: NotAnArray,
    name: Option<Value>,
    #[serde(rename = "generateName")]
    generate_name: Option<Value>,
    namespace: Option<Value>,
    labels: Option<Value>,
    annotations: Option<Value>,
}

#[derive(Deserialize)]
struct SpecIn {
    #[serde(rename = "\u{0}", default)]
    _object: NotAnArray,
    containers: Option<Vec<ContainerIn>>,
    #[serde(rename = "initContainers")]
    init_containers: Option<Vec<ContainerIn>>,
    #[serde(rename = "ephemeralContainers")]
    ephemeral_containers: Option<Vec<ContainerIn>>,
    volumes: Option<Value>,
    #[serde(rename = "securityContext")]
    security_context: Option<Value>,
    #[serde(rename = "hostNetwork")]
    host_network: Option<Value>,
    #[serde(rename = "hostPID")]
    host_pid: Option<Value>,
    #[serde(rename = "shareProcessNamespace")]
    share_process_namespace: Option<Value>,
    #[serde(rename = "restartPolicy")]
    restart_policy: Option<Value>,
}

#[derive(Deserialize)]
struct ContainerIn {
    #[serde(rename = "\u{0}", default)]
    _object: NotAnArray,
    name: Option<Value>,
    env: Option<Value>,
    #[serde(rename = "volumeMounts")]
    volume_mounts: Option<Value>,
    #[serde(rename = "volumeDevices")]
    volume_devices: Option<Value>,
    #[serde(rename = "securityContext")]
    security_context: Option<Value>,
}

fn insert(map: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(value) = value {
        map.insert(key.to_string(), value);
    }
}

fn object(fields: impl FnOnce(&mut Map<String, Value>)) -> Value {
    let mut map = Map::new();
    fields(&mut map);
    Value::Object(map)
}

impl ReviewIn {
    fn into_value(self) -> Value {
        object(|review| {
            insert(review, "apiVersion", self.api_version);
            insert(review, "kind", self.kind);
            insert(review, "request", self.request.map(RequestIn::into_value));
        })
    }
}

impl RequestIn {
    fn into_value(self) -> Value {
        object(|request| {
            insert(request, "uid", self.uid);
            insert(request, "kind", self.kind);
            insert(request, "subResource", self.sub_resource);
            insert(request, "operation", self.operation);
            insert(request, "namespace", self.namespace);
            insert(request, "name", self.name);
            insert(request, "dryRun", self.dry_run);
            insert(request, "object", self.object.map(ObjectIn::into_value));
        })
    }
}

impl ObjectIn {
    fn into_value(self) -> Value {
        object(|object| {
            insert(object, "metadata", self.metadata.map(MetadataIn::into_value));
            insert(object, "spec", self.spec.map(SpecIn::into_value));
        })
    }
}

impl MetadataIn {
    fn into_value(self) -> Value {
        object(|metadata| {
            insert(metadata, "name", self.name);
            insert(metadata, "generateName", self.generate_name);
            insert(metadata, "namespace", self.namespace);
            insert(metadata, "labels", self.labels);
            insert(metadata, "annotations", self.annotations);
        })
    }
}

impl SpecIn {
    fn into_value(self) -> Value {
        object(|spec| {
            insert(spec, "containers", self.containers.map(ContainerIn::list));
            insert(spec, "initContainers", self.init_containers.map(ContainerIn::list));
            insert(
                spec,
                "ephemeralContainers",
                self.ephemeral_containers.map(ContainerIn::list),
            );
            insert(spec, "volumes", self.volumes);
            insert(spec, "securityContext", self.security_context);
            insert(spec, "hostNetwork", self.host_network);
            insert(spec, "hostPID", self.host_pid);
            insert(spec, "shareProcessNamespace", self.share_process_namespace);
            insert(spec, "restartPolicy", self.restart_policy);
        })
    }
}

impl ContainerIn {
    fn list(containers: Vec<Self>) -> Value {
        Value::Array(containers.into_iter().map(Self::into_value).collect())
    }

    fn into_value(self) -> Value {
        object(|container| {
            insert(container, "name", self.name);
            insert(container, "env", self.env);
            insert(container, "volumeMounts", self.volume_mounts);
            insert(container, "volumeDevices", self.volume_devices);
            insert(container, "securityContext", self.security_context);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An array in place of an object leaves the fast path (serde would read an array of one
    /// element per field as the struct).
    #[test]
    fn arrays_in_place_of_objects_are_not_read_as_structs() {
        for body in [
            r#"["admission.k8s.io/v1", "AdmissionReview", null]"#,
            r#"{"request": ["u", null, null, null, null, null, null, null]}"#,
            r#"{"request": {"object": {"spec": {"initContainers": [["openshell-sidecar"]]}}}}"#,
            r#"{"request": {"object": {"spec": {"containers": [["app", null, null]]}}}}"#,
        ] {
            assert!(pruned(body.as_bytes()).is_none(), "{body}");
        }
        let fits = r#"{"request": {"object": {"spec": {"containers": [{"name": "app", "image": "x"}]}}}}"#;
        assert_eq!(
            pruned(fits.as_bytes()),
            Some(serde_json::json!({"request": {"object": {"spec": {"containers": [{"name": "app"}]}}}}))
        );
    }

    /// Before the guard, a `request` sent as an array of its eight fields was read by the fast
    /// path as a Pod CREATE and injected, while the whole-`Value` path refuses it.
    #[test]
    fn a_request_array_is_answered_as_the_value_path_answers_it() {
        let injector = crate::Injector::new(crate::InjectConfig::default());
        let body = serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": ["u-1", {"group": "", "kind": "Pod"}, null, "CREATE", "team-a", "p", false,
                {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app"}]}}],
        }))
        .unwrap_or_default();
        let fast = crate::review::mutate_bytes(&body, &injector);
        let slow = serde_json::from_slice(&body).map(|review| crate::review::mutate(&review, &injector));
        assert_eq!(Ok(fast), slow.map_err(|_| ()));
    }
}
