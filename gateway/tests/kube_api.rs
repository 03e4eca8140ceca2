//! The Kubernetes integration against a mock API server that answers only with bodies
//! captured from a real kube-apiserver v1.28.7 (`testdata/fixtures/kube-api/`, copied from `shared/fixtures/kube-api/`, see its
//! README): the namespace and Pod watches feeding the index (bookmarks, label-selector
//! deletions, a `410 Expired` inside a 200 stream, a 403 on the list), and `Kube`'s writes
//! (server-side apply of the token Secret, deletion, events.k8s.io Events with series, the
//! SupervisorPool status and the object when it is missing).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use futures::StreamExt;
use gateway::kubernetes::index::Index;
use gateway::kubernetes::notice::{self, Notice, Regarding};
use gateway::kubernetes::pool_status::PoolStatus;
use gateway::kubernetes::{Cluster, Kube, Shared, watch};
use gateway::tokens::Delivered;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::core::PartialObjectMeta;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use api::{Seen, reply, stream};

const NS_SELECTOR: &str = "supervision.openshell.ai/shared=enabled";
const POD_SELECTOR: &str = "supervision.openshell.ai/supervised=true";
const AGENT_A: &str = "944be8f4-4199-442a-af17-50c1bb811f7c";
const AGENT_B: &str = "376ce0ff-1e4c-4b04-ac8e-d579725eaa94";
const AGENT_C: &str = "fcdcc450-9d3a-4270-853d-ae9dbdfb0491";
const INSTANCE: &str = "supervision-gateway-7c9d5b8f4d-x2lqp";
const SECRET: &str = "openshell-supervision-token";

/// The mock API server: requests come off a `tower_test` handle, replies are fixture files
/// sent whole or line by line, always `Content-Type: application/json` (as the real server
/// answered, watch streams included).
mod api {
    use std::collections::BTreeMap;
    use std::convert::Infallible;

    use axum::body::{Body, Bytes};
    use http_body_util::BodyExt;
    use serde_json::Value;
    use tokio::sync::mpsc;
    use tokio::task::JoinHandle;

    /// The response body is axum's so a watch stream can be fed one line at a time
    /// (`kube::client::Body` has no public streaming constructor); `kube::Client::new`
    /// accepts any body.
    type Handle = tower_test::mock::Handle<http::Request<kube::client::Body>, http::Response<Body>>;
    pub type Responder = tower_test::mock::SendResponse<http::Response<Body>>;

    const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/fixtures/kube-api/");

    /// A captured response body, unchanged.
    pub fn fixture(name: &str) -> String {
        let path = format!("{DIR}{name}");
        std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("fixture {path}: {err}"))
    }

    /// One request as the mock server received it.
    #[derive(Debug, Clone)]
    pub struct Seen {
        pub method: http::Method,
        pub path: String,
        pub query: BTreeMap<String, String>,
        pub headers: http::HeaderMap,
        pub body: Vec<u8>,
    }

    impl Seen {
        pub fn param(&self, key: &str) -> Option<&str> {
            self.query.get(key).map(String::as_str)
        }

        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers.get(name).map(|v| v.to_str().expect("ASCII header"))
        }

        pub fn json(&self) -> Value {
            serde_json::from_slice(&self.body).unwrap_or_else(|err| {
                panic!(
                    "request body is not JSON ({err}): {}",
                    String::from_utf8_lossy(&self.body)
                )
            })
        }

        /// The request asks for metadata only (`PartialObjectMetadata[List]`), not whole objects.
        pub fn assert_metadata_only(&self) {
            let accept = self.header("accept").unwrap_or_default();
            let wanted = if self.is_watch() {
                "as=PartialObjectMetadata;"
            } else {
                "as=PartialObjectMetadataList;"
            };
            assert!(
                accept.contains(wanted) && accept.contains("g=meta.k8s.io"),
                "expected a metadata-only request, Accept: {accept:?}: {self:?}"
            );
        }

        pub fn is_watch(&self) -> bool {
            self.param("watch") == Some("true")
        }

        /// A GET of `path` listing (not watching) with `selector`.
        pub fn assert_list(&self, path: &str, selector: &str) {
            assert_eq!(
                (&self.method, self.path.as_str()),
                (&http::Method::GET, path),
                "{self:?}"
            );
            assert!(!self.is_watch(), "expected a list, got a watch: {self:?}");
            assert_eq!(self.param("labelSelector"), Some(selector), "{self:?}");
        }

        /// A watch of `path` from `resource_version` with `selector` and bookmarks.
        pub fn assert_watch(&self, path: &str, selector: &str, resource_version: &str) {
            assert_eq!(
                (&self.method, self.path.as_str()),
                (&http::Method::GET, path),
                "{self:?}"
            );
            assert!(self.is_watch(), "expected a watch, got: {self:?}");
            assert_eq!(self.param("resourceVersion"), Some(resource_version), "{self:?}");
            assert_eq!(self.param("labelSelector"), Some(selector), "{self:?}");
            assert_eq!(self.param("allowWatchBookmarks"), Some("true"), "{self:?}");
        }
    }

    pub struct Server {
        handle: Handle,
    }

    /// A client whose every request reaches the returned server.
    pub fn client() -> (kube::Client, Server) {
        let (service, handle) = tower_test::mock::pair();
        (kube::Client::new(service, "default"), Server { handle })
    }

    impl Server {
        /// The next request and the means to answer it.
        pub async fn next(&mut self) -> (Seen, Responder) {
            let (request, respond) = self.handle.next_request().await.expect("the client went away");
            let (parts, body) = request.into_parts();
            let body = body.collect().await.expect("request body").to_bytes().to_vec();
            let query = url::form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes())
                .into_owned()
                .collect();
            let seen = Seen {
                method: parts.method,
                path: parts.uri.path().to_owned(),
                query,
                headers: parts.headers,
                body,
            };
            (seen, respond)
        }

        /// The server loop as a task: each request in turn is checked by its step and
        /// answered with the step's status and fixture. Yields every request seen.
        pub fn serve(mut self, script: Vec<Step>) -> JoinHandle<Vec<Seen>> {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for step in script {
                    let (request, respond) = self.next().await;
                    (step.check)(&request);
                    reply(respond, step.status, step.fixture);
                    seen.push(request);
                }
                seen
            })
        }
    }

    /// One expected request of [`Server::serve`].
    pub struct Step {
        pub check: Box<dyn FnOnce(&Seen) + Send>,
        pub status: u16,
        pub fixture: &'static str,
    }

    pub fn step(check: impl FnOnce(&Seen) + Send + 'static, status: u16, fixture: &'static str) -> Step {
        Step {
            check: Box::new(check),
            status,
            fixture,
        }
    }

    fn response(status: u16, body: Body) -> http::Response<Body> {
        http::Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
            .expect("response")
    }

    /// Answer with a whole fixture.
    pub fn reply(respond: Responder, status: u16, fixture_name: &str) {
        respond.send_response(response(status, Body::from(fixture(fixture_name))));
    }

    /// Answer 200 with a body fed by the returned [`Lines`]; it ends when they are dropped.
    pub fn stream(respond: Responder) -> Lines {
        let (tx, rx) = mpsc::unbounded_channel::<Result<Bytes, Infallible>>();
        let chunks = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|chunk| (chunk, rx)) });
        respond.send_response(response(200, Body::from_stream(chunks)));
        Lines(tx)
    }

    /// The open end of a streamed response.
    pub struct Lines(mpsc::UnboundedSender<Result<Bytes, Infallible>>);

    impl Lines {
        /// Send one line (which keeps its `\n`).
        pub fn send(&self, line: &str) {
            self.0
                .send(Ok(Bytes::from(line.to_owned())))
                .expect("the client stopped reading the stream");
        }
    }

    /// The lines of an `.ndjson` fixture, each with its `\n`.
    pub fn lines(fixture_name: &str) -> Vec<String> {
        fixture(fixture_name).split_inclusive('\n').map(str::to_owned).collect()
    }
}

/// Wait until the index satisfies `condition`, woken by `Shared::changed`. The bound only
/// turns a hang into a failure.
async fn until(shared: &Shared, what: &str, condition: impl Fn(&Index) -> bool) {
    let reached = async {
        loop {
            // Created before the check: a change in between leaves a permit behind.
            let changed = shared.changed.notified();
            if shared.with(|index| condition(index)) {
                return;
            }
            changed.await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(30), reached).await.is_err() {
        let index = shared.with(|index| index.clone());
        panic!("the index never reached: {what}; it is {index:?}");
    }
}

fn pod_uids(index: &Index) -> BTreeSet<String> {
    index.pods().map(|pod| pod.uid.clone()).collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Stop a watch task and check it ended because of the shutdown (not a panic).
async fn stop(shutdown: &CancellationToken, task: JoinHandle<()>) {
    shutdown.cancel();
    task.await.expect("the watch task ended cleanly");
}

// ---------------------------------------------------------------------------------------
// Watches
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn namespace_watch_follows_a_label_added_and_removed_through_the_selector() {
    let (client, mut server) = api::client();
    let shared = Shared::default();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(watch::namespaces(client, shared.clone(), shutdown.clone()));

    let (list, respond) = server.next().await;
    list.assert_list("/api/v1/namespaces", NS_SELECTOR);
    reply(respond, 200, "namespaces-list-labelselector.json");
    until(&shared, "team-a listed and synced", |index| {
        index.namespaces_synced() && *index.labelled() == set(&["team-a"])
    })
    .await;

    // The watch resumes from the list's resourceVersion.
    let (watch, respond) = server.next().await;
    watch.assert_watch("/api/v1/namespaces", NS_SELECTOR, "486");
    let lines = api::lines("namespaces-watch-labelselector-label-added-removed.ndjson");
    assert_eq!(lines.len(), 4, "ADDED, DELETED, 2 BOOKMARKs");
    let feed = stream(respond);
    // ADDED: team-b gained the label.
    feed.send(&lines[0]);
    until(&shared, "team-b labelled", |index| index.labelled().contains("team-b")).await;
    // DELETED: team-b lost it (the object still carries the label: it is the old state).
    feed.send(&lines[1]);
    until(&shared, "team-b unlabelled", |index| {
        !index.labelled().contains("team-b") && index.unlabelled().contains("team-b")
    })
    .await;
    feed.send(&lines[2]);
    feed.send(&lines[3]);
    drop(feed);

    // The stream ended: the watcher watches again from the bookmarks' resourceVersion.
    let (rewatch, _held) = server.next().await;
    rewatch.assert_watch("/api/v1/namespaces", NS_SELECTOR, "489");
    shared.with(|index| {
        assert_eq!(*index.labelled(), set(&["team-a"]));
        assert_eq!(*index.unlabelled(), set(&["team-b"]));
        assert!(index.namespaces_synced());
    });
    stop(&shutdown, task).await;
}

#[tokio::test]
async fn pod_watch_follows_a_pod_added_and_deleted_and_survives_bookmarks() {
    let (client, mut server) = api::client();
    let shared = Shared::default();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(watch::pods(client, shared.clone(), shutdown.clone()));

    // Our watch is cluster-wide with our selector. The fixtures were captured in team-a
    // with `app=agent,supervision.openshell.ai/inject!=disabled`; the server's answer
    // has the same shape, so the requests are checked against what we send.
    let (list, respond) = server.next().await;
    list.assert_list("/api/v1/pods", POD_SELECTOR);
    list.assert_metadata_only();
    reply(respond, 200, "pods-list-labelselector.json");
    until(&shared, "agent-a and agent-b listed", |index| {
        index.pods_synced() && pod_uids(index) == set(&[AGENT_A, AGENT_B])
    })
    .await;

    let (watch, respond) = server.next().await;
    watch.assert_watch("/api/v1/pods", POD_SELECTOR, "480");
    watch.assert_metadata_only();
    let lines = api::lines("pods-watch-added-modified-deleted.ndjson");
    assert_eq!(lines.len(), 6, "ADDED, 2 MODIFIED, DELETED, 2 BOOKMARKs");
    let feed = stream(respond);
    feed.send(&lines[0]);
    until(&shared, "agent-c added", |index| index.has_pod(AGENT_C)).await;
    let added = shared.with(|index| index.pods().find(|pod| pod.uid == AGENT_C).cloned());
    let added = added.expect("agent-c");
    assert_eq!((added.namespace.as_str(), added.name.as_str()), ("team-a", "agent-c"));
    // MODIFIED (label added), MODIFIED (deletionTimestamp), DELETED.
    for line in &lines[1..4] {
        feed.send(line);
    }
    until(&shared, "agent-c deleted", |index| !index.has_pod(AGENT_C)).await;
    // Two bookmarks whose Pod skeleton has `spec.containers: null`.
    feed.send(&lines[4]);
    feed.send(&lines[5]);
    drop(feed);

    let (rewatch, _held) = server.next().await;
    rewatch.assert_watch("/api/v1/pods", POD_SELECTOR, "485");
    rewatch.assert_metadata_only();
    shared.with(|index| {
        assert_eq!(pod_uids(index), set(&[AGENT_A, AGENT_B]));
        assert!(index.pods_synced());
    });
    assert!(!task.is_finished());
    stop(&shutdown, task).await;
}

/// The watcher only ever sees what kube decodes; check that the skeleton bookmarks decode as
/// bookmarks (not as broken Pods) and carry the resourceVersion to resume from.
#[tokio::test]
async fn pod_bookmarks_with_null_containers_decode_as_bookmarks() {
    let (client, mut server) = api::client();
    let pods: Api<PartialObjectMeta<Pod>> = Api::all(client);
    let served = tokio::spawn(async move {
        let (watch, respond) = server.next().await;
        assert!(watch.is_watch());
        watch.assert_metadata_only();
        reply(respond, 200, "pods-watch-added-modified-deleted.ndjson");
    });
    let events: Vec<_> = pods
        .watch(&WatchParams::default(), "480")
        .await
        .expect("watch starts")
        .collect()
        .await;
    served.await.expect("server");
    let events: Vec<WatchEvent<PartialObjectMeta<Pod>>> =
        events.into_iter().map(|e| e.expect("every line decodes")).collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|event| match event {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Modified(_) => "MODIFIED",
            WatchEvent::Deleted(_) => "DELETED",
            WatchEvent::Bookmark(_) => "BOOKMARK",
            WatchEvent::Error(_) => "ERROR",
        })
        .collect();
    assert_eq!(
        kinds,
        ["ADDED", "MODIFIED", "MODIFIED", "DELETED", "BOOKMARK", "BOOKMARK"]
    );
    let WatchEvent::Bookmark(bookmark) = &events[5] else {
        unreachable!()
    };
    assert_eq!(bookmark.metadata.resource_version, "485");
    let WatchEvent::Modified(deleting) = &events[2] else {
        unreachable!()
    };
    assert!(deleting.metadata.deletion_timestamp.is_some());
    assert!(
        watch::pod_of(deleting).is_some(),
        "a Pod being deleted is still a Pod until DELETED"
    );
}

#[tokio::test(start_paused = true)]
async fn pod_watch_relists_after_a_410_inside_the_stream() {
    let (client, mut server) = api::client();
    let shared = Shared::default();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(watch::pods(client, shared.clone(), shutdown.clone()));

    let (list, respond) = server.next().await;
    list.assert_list("/api/v1/pods", POD_SELECTOR);
    list.assert_metadata_only();
    reply(respond, 200, "pods-list-labelselector.json");
    until(&shared, "first list", |index| index.pods_synced()).await;
    let first = shared.with(|index| index.version());

    // HTTP 200 whose only line is an ERROR event with a 410 Status (captured for
    // resourceVersion=1; the server answers any expired version this way).
    let (watch, respond) = server.next().await;
    watch.assert_watch("/api/v1/pods", POD_SELECTOR, "480");
    watch.assert_metadata_only();
    reply(respond, 200, "pods-watch-too-old-resourceversion.ndjson");

    // After the backoff (paused time advances it), a full list again, not a watch.
    let (relist, respond) = server.next().await;
    relist.assert_list("/api/v1/pods", POD_SELECTOR);
    relist.assert_metadata_only();
    reply(respond, 200, "pods-list-labelselector.json");
    until(&shared, "the relist reset the index", |index| index.version() > first).await;

    let (watch, _held) = server.next().await;
    watch.assert_watch("/api/v1/pods", POD_SELECTOR, "480");
    watch.assert_metadata_only();
    shared.with(|index| {
        assert_eq!(pod_uids(index), set(&[AGENT_A, AGENT_B]));
        assert!(index.pods_synced());
    });
    stop(&shutdown, task).await;
}

#[tokio::test(start_paused = true)]
async fn pod_watch_retries_a_forbidden_list_with_backoff() {
    let (client, mut server) = api::client();
    let shared = Shared::default();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(watch::pods(client, shared.clone(), shutdown.clone()));

    let (list, respond) = server.next().await;
    list.assert_list("/api/v1/pods", POD_SELECTOR);
    list.assert_metadata_only();
    reply(respond, 403, "rbac-forbidden-list-pods.json");

    // The task lives on and lists again after its backoff.
    let (again, respond) = server.next().await;
    again.assert_list("/api/v1/pods", POD_SELECTOR);
    again.assert_metadata_only();
    assert!(!task.is_finished());
    assert!(
        !shared.with(|index| index.pods_synced()),
        "a refused list syncs nothing"
    );
    reply(respond, 200, "pods-list-labelselector.json");
    until(&shared, "listed once permitted", |index| {
        index.pods_synced() && pod_uids(index) == set(&[AGENT_A, AGENT_B])
    })
    .await;

    let (watch, _held) = server.next().await;
    watch.assert_watch("/api/v1/pods", POD_SELECTOR, "480");
    watch.assert_metadata_only();
    stop(&shutdown, task).await;
}

// ---------------------------------------------------------------------------------------
// Kube: Secrets
// ---------------------------------------------------------------------------------------

fn delivered() -> Delivered {
    Delivered {
        token: Some("eyJhbGciOiJFZERTQSJ9.fake-token-3.c2ln".to_owned()),
        expires_at_ms: 1_795_942_538_000,
        trust_jwks:
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","kid":"k1","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#
                .to_owned(),
        ca_pem: None,
    }
}

fn assert_apply(request: &Seen, delivered: &Delivered) {
    assert_eq!(request.method, http::Method::PATCH);
    assert_eq!(request.path, format!("/api/v1/namespaces/team-a/secrets/{SECRET}"));
    assert_eq!(request.param("fieldManager"), Some("supervision-gateway"));
    assert_eq!(request.param("force"), Some("true"));
    assert_eq!(request.header("content-type"), Some("application/apply-patch+yaml"));
    let body = request.json();
    assert_eq!(body["apiVersion"], "v1");
    assert_eq!(body["kind"], "Secret");
    assert_eq!(body["type"], "Opaque");
    assert_eq!(body["metadata"]["name"], SECRET);
    assert_eq!(body["metadata"]["namespace"], "team-a");
    assert_eq!(
        body["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "supervision-gateway"
    );
    let data = body["data"].as_object().expect("data");
    // ca.crt always (empty without a CA): the sidecars' projected volume names the key.
    let keys = vec!["ca.crt", "token", "trust.jwks"];
    assert_eq!(
        data["ca.crt"],
        STANDARD.encode(delivered.ca_pem.as_deref().unwrap_or_default())
    );
    assert_eq!(data.keys().collect::<Vec<_>>(), keys);
    assert_eq!(data["token"], STANDARD.encode(delivered.token.as_deref().unwrap()));
    assert_eq!(data["trust.jwks"], STANDARD.encode(&delivered.trust_jwks));
    // Server-side apply owns what it sends: no resourceVersion pinning a stale copy.
    assert!(body["metadata"].get("resourceVersion").is_none());
}

/// Run `call` against a server following `script`; panics in the server come first.
async fn against<T>(server: api::Server, script: Vec<api::Step>, call: impl Future<Output = T>) -> (T, Vec<Seen>) {
    let served = server.serve(script);
    let out = call.await;
    let seen = served
        .await
        .unwrap_or_else(|err| std::panic::resume_unwind(err.into_panic()));
    (out, seen)
}

#[tokio::test]
async fn apply_secret_creates_and_updates_by_server_side_apply() {
    let delivered = delivered();
    assert!(
        !format!("{delivered:?}").contains(delivered.token.as_deref().unwrap()),
        "Debug leaks the token: {delivered:?}"
    );

    // The Secret did not exist: 201. (The fixture is of a Secret named supervision-trust;
    // the client does not read the name back.)
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let expect = delivered.clone();
    let script = vec![api::step(
        move |r| assert_apply(r, &expect),
        201,
        "secret-apply-create.json",
    )];
    let (created, seen) = against(server, script, kube.apply_secret("team-a", SECRET, &delivered)).await;
    created.expect("created");
    assert_eq!(seen.len(), 1);

    // It existed: 200, same request (now with the pool's CA bundle beside the token).
    let delivered = delivered.with_ca(Some(
        "-----BEGIN CERTIFICATE-----\nZmFrZS1jYQ==\n-----END CERTIFICATE-----\n".into(),
    ));
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let expect = delivered.clone();
    let script = vec![api::step(
        move |r| assert_apply(r, &expect),
        200,
        "secret-apply-existing.json",
    )];
    let (updated, _) = against(server, script, kube.apply_secret("team-a", SECRET, &delivered)).await;
    updated.expect("updated");
}

#[tokio::test]
async fn apply_secret_reports_a_refusal() {
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    // Captured for a POST of a Secret; a refused apply gets the same Status shape.
    let script = vec![api::step(|_| {}, 403, "rbac-forbidden-create-secret.json")];
    let (result, _) = against(server, script, kube.apply_secret("team-a", SECRET, &delivered())).await;
    let err = result.expect_err("forbidden");
    assert!(err.to_string().contains("forbidden"), "{err}");
    assert!(
        !err.to_string().contains(delivered().token.as_deref().unwrap()),
        "the error must not carry the token: {err}"
    );
}

fn assert_delete(request: &Seen) {
    assert_eq!(request.method, http::Method::DELETE);
    assert_eq!(request.path, format!("/api/v1/namespaces/team-a/secrets/{SECRET}"));
}

#[tokio::test]
async fn delete_secret_accepts_a_status_and_a_404_and_reports_a_refusal() {
    // 200 with a Status (for Secrets the server does not return the deleted object).
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let script = vec![api::step(assert_delete, 200, "secret-delete.json")];
    let (deleted, _) = against(server, script, kube.delete_secret("team-a", SECRET)).await;
    deleted.expect("deleted");

    // Already gone.
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let script = vec![api::step(assert_delete, 404, "secret-get-after-delete.json")];
    let (gone, _) = against(server, script, kube.delete_secret("team-a", SECRET)).await;
    gone.expect("a missing Secret counts as deleted");

    // Forbidden (captured for a create; a refused delete has the same shape).
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let script = vec![api::step(assert_delete, 403, "rbac-forbidden-create-secret.json")];
    let (refused, _) = against(server, script, kube.delete_secret("team-a", SECRET)).await;
    let err = refused.expect_err("a 403 is an error");
    assert!(err.to_string().contains("forbidden"), "{err}");
}

// ---------------------------------------------------------------------------------------
// Kube: Events
// ---------------------------------------------------------------------------------------

fn recovered(note: &str) -> Notice {
    Notice {
        regarding: Regarding {
            namespace: "team-a".to_owned(),
            name: "agent-a".to_owned(),
            uid: Some(AGENT_A.to_owned()),
        },
        related: Some(Regarding {
            namespace: "shared-supervision".to_owned(),
            name: "supervisor-1".to_owned(),
            uid: None,
        }),
        warning: false,
        reason: notice::REASON_RECOVERED,
        action: "Recover",
        note: note.to_owned(),
    }
}

const NOTE: &str = "instance team-a/agent-a recovered by member supervisor-1 (term 3)";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/team-a/events";

/// The POST of a new Event; returns its name.
fn assert_create(request: &Seen, note: &str) -> String {
    assert_eq!((&request.method, request.path.as_str()), (&http::Method::POST, EVENTS));
    assert_eq!(request.header("content-type"), Some("application/json"));
    let body = request.json();
    assert_eq!(body["apiVersion"], "events.k8s.io/v1");
    assert_eq!(body["kind"], "Event");
    assert_eq!(body["metadata"]["namespace"], "team-a");
    assert_eq!(body["reportingController"], "supervision.openshell.ai/gateway");
    assert_eq!(body["reportingInstance"], INSTANCE);
    assert!(body["eventTime"].as_str().is_some_and(|t| !t.is_empty()), "{body}");
    assert_eq!(body["type"], "Normal");
    assert_eq!(body["reason"], "InstanceRecovered");
    assert_eq!(body["action"], "Recover");
    assert_eq!(body["note"], note);
    assert!(body.get("series").is_none_or(Value::is_null), "{body}");
    let regarding = &body["regarding"];
    assert_eq!(regarding["apiVersion"], "v1");
    assert_eq!(regarding["kind"], "Pod");
    assert_eq!(regarding["namespace"], "team-a");
    assert_eq!(regarding["name"], "agent-a");
    assert_eq!(regarding["uid"], AGENT_A);
    // The member involved is the related object (a recovery by another member is another Event).
    assert_eq!(body["related"]["kind"], "Pod");
    assert_eq!(body["related"]["name"], "supervisor-1");
    let name = body["metadata"]["name"].as_str().expect("name").to_owned();
    assert!(name.starts_with("agent-a."), "client-go naming: {name}");
    name
}

#[tokio::test]
async fn publish_creates_an_event_then_patches_its_series() {
    let (client, mut server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let notice = recovered(NOTE);

    let serve_create = async {
        let (request, respond) = server.next().await;
        let name = assert_create(&request, NOTE);
        reply(respond, 201, "event-create.json");
        name
    };
    let (created, name) = tokio::join!(kube.publish(&notice), serve_create);
    created.expect("created");

    // The same notice again: a merge patch of the same Event, now a series of 2.
    let serve_patch = async {
        let (request, respond) = server.next().await;
        assert_eq!(request.method, http::Method::PATCH);
        assert_eq!(request.path, format!("{EVENTS}/{name}"));
        assert_eq!(request.header("content-type"), Some("application/merge-patch+json"));
        let body = request.json();
        assert_eq!(body["series"]["count"], 2);
        assert!(body["series"]["lastObservedTime"].is_string(), "{body}");
        // `note` is immutable (event-patch-note-immutable.json): the patch keeps it.
        assert_eq!(body["note"], NOTE);
        reply(respond, 200, "event-patch-series-add.json");
    };
    let (patched, ()) = tokio::join!(kube.publish(&notice), serve_patch);
    patched.expect("series added");
}

#[tokio::test]
async fn publish_reports_an_invalid_event_and_does_not_start_a_series() {
    let (client, mut server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let notice = recovered(NOTE);

    let refuse = async {
        let (request, respond) = server.next().await;
        assert_create(&request, NOTE);
        reply(respond, 422, "event-create-missing-reportinginstance.json");
    };
    let (refused, ()) = tokio::join!(kube.publish(&notice), refuse);
    let err = refused.expect_err("a 422 is an error");
    assert!(err.to_string().contains("reportingInstance: Required value"), "{err}");

    // Nothing was created, so the next try creates (a PATCH would hit a missing Event).
    let create = async {
        let (request, respond) = server.next().await;
        assert_create(&request, NOTE);
        reply(respond, 201, "event-create.json");
    };
    let (created, ()) = tokio::join!(kube.publish(&notice), create);
    created.expect("created on retry");
}

async fn serve_create(server: &mut api::Server, note: &str) -> String {
    let (request, respond) = server.next().await;
    let name = assert_create(&request, note);
    reply(respond, 201, "event-create.json");
    name
}

async fn serve_series(server: &mut api::Server, name: &str, status: u16, fixture: &str) {
    let (request, respond) = server.next().await;
    assert_eq!(request.method, http::Method::PATCH);
    assert_eq!(request.path, format!("{EVENTS}/{name}"));
    let body = request.json();
    assert_eq!(body["series"]["count"], 2);
    assert!(body["series"]["lastObservedTime"].is_string(), "{body}");
    reply(respond, status, fixture);
}

/// Events told apart by their note (one per denied destination): each note its own Event,
/// a repeat of one patches that one's series, and an Event the API server expired meanwhile
/// is created anew.
#[tokio::test]
async fn publish_distinct_keeps_one_event_and_series_per_note() {
    let (client, mut server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let (first, second) = ("egress to a.example:443 denied", "egress to b.example:443 denied");
    let (to_a, to_b) = (recovered(first), recovered(second));

    let (created, a) = tokio::join!(kube.publish_distinct(&to_a), serve_create(&mut server, first));
    created.expect("created");
    let (created, b) = tokio::join!(kube.publish_distinct(&to_b), serve_create(&mut server, second));
    created.expect("a second Event for the second note, not a patch of the first");
    assert_ne!(a, b);

    let (patched, ()) = tokio::join!(
        kube.publish_distinct(&to_a),
        serve_series(&mut server, &a, 200, "event-patch-series-add.json")
    );
    patched.expect("the first note's series");

    // The second Event expired on the server: created again. (A NotFound Status as the API
    // server answers it, captured for a Secret: only the code is read.)
    let expired = async {
        serve_series(&mut server, &b, 404, "secret-get-after-delete.json").await;
        serve_create(&mut server, second).await
    };
    let (recreated, _) = tokio::join!(kube.publish_distinct(&to_b), expired);
    recreated.expect("created anew");
}

// ---------------------------------------------------------------------------------------
// Kube: the SupervisorPool status
// ---------------------------------------------------------------------------------------

const POOL_PATH: &str =
    "/apis/supervision.openshell.ai/v1alpha1/namespaces/openshell-supervision/supervisorpools/openshell";

fn pool_status() -> PoolStatus {
    PoolStatus {
        ready_members: "2/2".into(),
        ready_instances: "5/5".into(),
        ..PoolStatus::default()
    }
}

/// A server-side apply by the gateway's field manager, forced.
fn assert_pool_apply(request: &Seen, path: &str) -> Value {
    assert_eq!((&request.method, request.path.as_str()), (&http::Method::PATCH, path));
    assert_eq!(request.param("fieldManager"), Some("supervision-gateway"));
    assert_eq!(request.param("force"), Some("true"));
    assert_eq!(request.header("content-type"), Some("application/apply-patch+yaml"));
    let body = request.json();
    assert_eq!(body["apiVersion"], "supervision.openshell.ai/v1alpha1");
    assert_eq!(body["kind"], "SupervisorPool");
    assert_eq!(body["metadata"]["name"], "openshell");
    assert_eq!(body["metadata"]["namespace"], "openshell-supervision");
    body
}

#[tokio::test]
async fn pool_status_is_applied_to_the_status_subresource_and_the_object_created_when_missing() {
    // The object exists: one apply of its status. (The fixtures are captured answers for a
    // Secret; the client reads nothing back but the status code.)
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let status_path = format!("{POOL_PATH}/status");
    let expect = status_path.clone();
    let script = vec![api::step(
        move |r| {
            let body = assert_pool_apply(r, &expect);
            assert_eq!(body["status"]["readyMembers"], "2/2");
            assert!(body.get("spec").is_none(), "the status apply owns only the status");
        },
        200,
        "secret-apply-existing.json",
    )];
    let (applied, seen) = against(
        server,
        script,
        kube.apply_pool_status("openshell-supervision", "openshell", &pool_status()),
    )
    .await;
    applied.expect("applied");
    assert_eq!(seen.len(), 1);

    // Missing (404 on the status): the object is applied with an empty spec, then its status.
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    let (first, last) = (status_path.clone(), status_path.clone());
    let script = vec![
        api::step(
            move |r| drop(assert_pool_apply(r, &first)),
            404,
            "secret-get-after-delete.json",
        ),
        api::step(
            |r| {
                let body = assert_pool_apply(r, POOL_PATH);
                assert_eq!(body["spec"], serde_json::json!({}));
                assert_eq!(
                    body["metadata"]["labels"]["app.kubernetes.io/managed-by"],
                    "supervision-gateway"
                );
            },
            201,
            "secret-apply-create.json",
        ),
        api::step(
            move |r| assert_eq!(assert_pool_apply(r, &last)["status"]["readyInstances"], "5/5"),
            200,
            "secret-apply-existing.json",
        ),
    ];
    let (created, seen) = against(
        server,
        script,
        kube.apply_pool_status("openshell-supervision", "openshell", &pool_status()),
    )
    .await;
    created.expect("created, then its status applied");
    assert_eq!(seen.len(), 3);
}

#[tokio::test]
async fn a_refused_pool_status_is_reported_and_creates_nothing() {
    let (client, server) = api::client();
    let kube = Kube::new(client, INSTANCE);
    // Captured for a POST of a Secret; an RBAC refusal of the status patch has the same shape.
    let script = vec![api::step(|_| {}, 403, "rbac-forbidden-create-secret.json")];
    let (result, seen) = against(
        server,
        script,
        kube.apply_pool_status("openshell-supervision", "openshell", &pool_status()),
    )
    .await;
    let err = result.expect_err("forbidden");
    assert!(err.to_string().contains("forbidden"), "{err}");
    assert_eq!(seen.len(), 1, "no attempt to create the object after a refusal");
}

/// A well-formed token for the gateway's audience (its signature is the API server's business).
fn service_account_token(n: usize) -> String {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let payload = serde_json::json!({"aud": ["openshell-gateway"], "exp": exp, "sub": format!("n{n}")});
    format!(
        "{}.{}.{}",
        URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","kid":"k"}"#),
        URL_SAFE_NO_PAD.encode(payload.to_string()),
        URL_SAFE_NO_PAD.encode(b"signature")
    )
}

#[tokio::test]
async fn garbage_bearer_strings_never_reach_the_api_server_and_one_peer_holds_a_few_reviews_at_most() {
    use gateway::kubernetes::review::{self, MAX_IN_FLIGHT_PER_SOURCE, Review};
    let (client, mut server) = api::client();
    let reviewer = std::sync::Arc::new(review::Kube::new(client, "openshell-gateway"));
    let attacker: review::Source = Some("10.9.9.9".parse().unwrap());

    // Distinct garbage strings: refused at once, no TokenReview, nothing held.
    for n in 0..200 {
        let answer = reviewer.review(&format!("garbage-{n}"), attacker).await;
        assert!(matches!(answer, Err(review::Error::Malformed(_))), "{answer:?}");
    }
    let wrong_audience = {
        use base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let payload = serde_json::json!({"aud": ["https://kubernetes.default.svc"], "exp": 9_999_999_999_i64});
        format!(
            "{}.{}.c2ln",
            URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256"}"#),
            URL_SAFE_NO_PAD.encode(payload.to_string())
        )
    };
    assert!(matches!(
        reviewer.review(&wrong_audience, attacker).await,
        Err(review::Error::Malformed(_))
    ));

    // Well-formed tokens are reviewed, but one peer has at most its share in flight.
    let pending: Vec<_> = (0..MAX_IN_FLIGHT_PER_SOURCE)
        .map(|n| {
            let reviewer = reviewer.clone();
            tokio::spawn(async move { reviewer.review(&service_account_token(n), attacker).await })
        })
        .collect();
    let mut held = Vec::new();
    for _ in 0..MAX_IN_FLIGHT_PER_SOURCE {
        let (seen, respond) = tokio::time::timeout(Duration::from_secs(5), server.next())
            .await
            .expect("a review");
        assert_eq!(seen.path, "/apis/authentication.k8s.io/v1/tokenreviews");
        held.push(respond);
    }
    let busy = reviewer.review(&service_account_token(99), attacker).await;
    assert!(matches!(busy, Err(review::Error::Busy)), "{busy:?}");
    // Another peer still gets its review.
    let other = {
        let reviewer = reviewer.clone();
        tokio::spawn(async move {
            reviewer
                .review(&service_account_token(100), Some("10.1.1.1".parse().unwrap()))
                .await
        })
    };
    let (_, respond) = tokio::time::timeout(Duration::from_secs(5), server.next())
        .await
        .expect("the other peer's review");
    reply(respond, 201, "tokenreview-bound-pod-token-authenticated.json");
    assert!(other.await.unwrap().is_ok());
    for respond in held {
        reply(respond, 201, "tokenreview-wrong-audience.json");
    }
    for answer in pending {
        assert!(matches!(answer.await.unwrap(), Err(review::Error::Refused(_))));
    }
}
