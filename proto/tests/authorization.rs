//! The authorization inventory (`proto/AUTHORIZATION.md`) names every RPC of the compiled
//! descriptors — the pool's contracts and the standard health and reflection services every
//! gRPC port serves — exactly once, and nothing else: an API change is always an
//! authorization decision too. Only the standard services are open to callers without a
//! credential.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;

use prost::Message as _;
use prost_types::FileDescriptorSet;

const INVENTORY: &str = include_str!("../AUTHORIZATION.md");
const CALLERS: [&str; 4] = ["member", "instance", "operator", "nobody"];

/// The descriptor sets of everything a gRPC port serves.
const SERVED: [&[u8]; 4] = [
    proto::FILE_DESCRIPTOR_SET,
    tonic_health::pb::FILE_DESCRIPTOR_SET,
    tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
    tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
];

/// (service, method) of every compiled RPC.
fn compiled() -> BTreeSet<(String, String)> {
    let mut rpcs = BTreeSet::new();
    let files = SERVED
        .iter()
        .flat_map(|set| FileDescriptorSet::decode(*set).expect("a descriptor set").file);
    for file in files {
        let package = file.package.clone().unwrap_or_default();
        for service in &file.service {
            for method in &service.method {
                rpcs.insert((format!("{package}.{}", service.name()), method.name().to_owned()));
            }
        }
    }
    rpcs
}

/// The inventory's rows: (service, method, caller).
fn inventory() -> Vec<(String, String, String)> {
    INVENTORY
        .lines()
        .filter(|l| l.starts_with("| openshell.") || l.starts_with("| grpc."))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            assert!(cells.len() == 4, "a row has service, method, caller, acts on: {l}");
            (cells[0].to_owned(), cells[1].to_owned(), cells[2].to_owned())
        })
        .collect()
}

#[test]
fn every_rpc_has_exactly_one_authorization_row() {
    let rows = inventory();
    let listed: BTreeSet<(String, String)> = rows.iter().map(|(s, m, _)| (s.clone(), m.clone())).collect();
    assert_eq!(listed.len(), rows.len(), "an RPC is listed twice");
    let compiled = compiled();
    let missing: Vec<_> = compiled.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&compiled).collect();
    assert!(missing.is_empty(), "RPCs without an authorization row: {missing:?}");
    assert!(unknown.is_empty(), "rows for RPCs that do not exist: {unknown:?}");
}

#[test]
fn every_row_names_a_known_kind_of_caller() {
    for (service, method, caller) in inventory() {
        assert!(
            CALLERS.iter().any(|c| caller.starts_with(c)),
            "{service}.{method}: unknown caller {caller:?}"
        );
        let standard = proto::standard::STANDARD_SERVICES.contains(&service.as_str());
        assert_eq!(
            caller.starts_with("nobody"),
            standard,
            "{service}.{method}: only the standard health and reflection services are open \
             to callers without a credential, and they are open to every caller"
        );
    }
}
