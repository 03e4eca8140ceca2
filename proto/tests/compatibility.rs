//! The wire rules of the compatibility policy (docs/operate.md, "Versions and skew"), checked
//! against the previous release (`release/previous`): every message, field, enum value and
//! method the release's contracts had is still there with the same number, name and type — or,
//! for a field or value, its number and name are reserved. A breaking change is a new package,
//! served beside the old one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message;
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorSet, ServiceDescriptorProto};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The commit of the previous release (`scripts/previous-release`: `release/previous`, its
/// commit fetched into a shallow clone), or why there is none.
fn previous_release() -> Result<String, String> {
    let out = Command::new(repository().join("scripts/previous-release"))
        .output()
        .map_err(|err| err.to_string())?;
    let said = String::from_utf8_lossy(&out.stdout);
    match said.split_whitespace().nth(1) {
        Some(commit) if out.status.success() => Ok(commit.to_owned()),
        _ => Err(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
    }
}

fn git(args: &[&str]) -> Vec<u8> {
    let out = Command::new("git")
        .args(args)
        .current_dir(repository())
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The descriptors of the `.proto` files under `root` (well-known imports left out).
fn compile(root: &Path) -> FileDescriptorSet {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "proto") {
                files.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let out = tempfile::tempdir().unwrap();
    let set = out.path().join("set.bin");
    let status = Command::new(protoc_bin_vendored::protoc_bin_path().unwrap())
        .arg(format!("--descriptor_set_out={}", set.display()))
        .arg("-I")
        .arg(root)
        .arg("-I")
        .arg(protoc_bin_vendored::include_path().unwrap())
        .args(&files)
        .status()
        .unwrap();
    assert!(status.success(), "protoc failed on {}", root.display());
    FileDescriptorSet::decode(std::fs::read(set).unwrap().as_slice()).unwrap()
}

/// Messages, enums and services by full name.
#[derive(Default)]
struct Contracts {
    messages: BTreeMap<String, DescriptorProto>,
    enums: BTreeMap<String, EnumDescriptorProto>,
    services: BTreeMap<String, ServiceDescriptorProto>,
}

impl Contracts {
    fn of(set: &FileDescriptorSet) -> Self {
        let mut contracts = Self::default();
        for file in &set.file {
            let package = file.package();
            for message in &file.message_type {
                contracts.add_message(package, message);
            }
            for e in &file.enum_type {
                contracts.enums.insert(format!("{package}.{}", e.name()), e.clone());
            }
            for service in &file.service {
                contracts
                    .services
                    .insert(format!("{package}.{}", service.name()), service.clone());
            }
        }
        contracts
    }

    fn add_message(&mut self, scope: &str, message: &DescriptorProto) {
        let name = format!("{scope}.{}", message.name());
        for nested in &message.nested_type {
            self.add_message(&name, nested);
        }
        for e in &message.enum_type {
            self.enums.insert(format!("{name}.{}", e.name()), e.clone());
        }
        self.messages.insert(name, message.clone());
    }
}

/// What `new` breaks of `old`, one line each.
fn breaks(old: &FileDescriptorSet, new: &FileDescriptorSet) -> Vec<String> {
    let (old, new) = (Contracts::of(old), Contracts::of(new));
    let mut problems = Vec::new();
    for (name, was) in &old.messages {
        let Some(now) = new.messages.get(name) else {
            problems.push(format!("message {name} was removed"));
            continue;
        };
        for field in &was.field {
            let number = field.number();
            let kept = now.field.iter().find(|f| f.number() == number);
            match kept {
                Some(f)
                    if f.name() == field.name()
                        && f.r#type() == field.r#type()
                        && f.type_name() == field.type_name()
                        && f.label() == field.label() => {}
                Some(f) => problems.push(format!(
                    "{name}: field {number} was `{}` {:?} {:?} {}, is `{}` {:?} {:?} {}",
                    field.name(),
                    field.label(),
                    field.r#type(),
                    field.type_name(),
                    f.name(),
                    f.label(),
                    f.r#type(),
                    f.type_name()
                )),
                None => {
                    let number_reserved = now
                        .reserved_range
                        .iter()
                        .any(|r| (r.start()..r.end()).contains(&number));
                    let name_reserved = now.reserved_name.iter().any(|n| n == field.name());
                    if !(number_reserved && name_reserved) {
                        problems.push(format!(
                            "{name}: field {number} `{}` was removed without reserving its number and name",
                            field.name()
                        ));
                    }
                }
            }
        }
    }
    for (name, was) in &old.enums {
        let Some(now) = new.enums.get(name) else {
            problems.push(format!("enum {name} was removed"));
            continue;
        };
        for value in &was.value {
            let number = value.number();
            match now.value.iter().find(|v| v.number() == number) {
                Some(v) if v.name() == value.name() => {}
                Some(v) => problems.push(format!("{name}: value {number} was {}, is {}", value.name(), v.name())),
                None => {
                    // An enum's reserved range includes its end.
                    let number_reserved = now
                        .reserved_range
                        .iter()
                        .any(|r| (r.start()..=r.end()).contains(&number));
                    let name_reserved = now.reserved_name.iter().any(|n| n == value.name());
                    if !(number_reserved && name_reserved) {
                        problems.push(format!(
                            "{name}: value {number} {} was removed without reserving its number and name",
                            value.name()
                        ));
                    }
                }
            }
        }
    }
    for (name, was) in &old.services {
        let Some(now) = new.services.get(name) else {
            problems.push(format!("service {name} was removed"));
            continue;
        };
        for method in &was.method {
            let same = now.method.iter().find(|m| m.name() == method.name()).is_some_and(|m| {
                m.input_type() == method.input_type()
                    && m.output_type() == method.output_type()
                    && m.client_streaming() == method.client_streaming()
                    && m.server_streaming() == method.server_streaming()
            });
            if !same {
                problems.push(format!(
                    "{name}.{} was removed or changed its messages or streaming",
                    method.name()
                ));
            }
        }
    }
    problems
}

/// `files` (path, text) compiled in a scratch directory.
fn compiled(files: &[(&str, &str)]) -> FileDescriptorSet {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    compile(dir.path())
}

#[test]
fn this_builds_contracts_keep_everything_the_previous_release_had() {
    let commit = match previous_release() {
        Ok(commit) => commit,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let old = tempfile::tempdir().unwrap();
    let listing = String::from_utf8(git(&["ls-tree", "-r", "--name-only", &commit, "--", "proto/proto"])).unwrap();
    for file in listing.lines().filter(|f| f.ends_with(".proto")) {
        let text = git(&["show", &format!("{commit}:{file}")]);
        let path = old.path().join(file.strip_prefix("proto/proto/").unwrap());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let problems = breaks(&compile(old.path()), &compile(&repository().join("proto/proto")));
    assert!(
        problems.is_empty(),
        "the contracts break the previous release ({commit}); a breaking change is a new package served beside the old:\n{}",
        problems.join("\n")
    );
}

#[test]
fn a_removed_field_value_or_method_is_found_unless_reserved() {
    let old = compiled(&[(
        "a/v1/a.proto",
        r#"syntax = "proto3"; package a.v1;
        message M { string name = 1; uint64 term = 2; repeated string tags = 3; }
        enum E { E_UNSPECIFIED = 0; E_ONE = 1; E_TWO = 2; }
        service S { rpc Call(M) returns (M); rpc Watch(M) returns (stream M); }"#,
    )]);
    let grown = compiled(&[(
        "a/v1/a.proto",
        r#"syntax = "proto3"; package a.v1;
        message M { reserved 3; reserved "tags"; string name = 1; uint64 term = 2; bool more = 4; }
        message N { string x = 1; }
        enum E { reserved 2; reserved "E_TWO"; E_UNSPECIFIED = 0; E_ONE = 1; E_THREE = 3; }
        service S { rpc Call(M) returns (M); rpc Watch(M) returns (stream M); rpc Other(N) returns (N); }"#,
    )]);
    assert_eq!(
        breaks(&old, &grown),
        Vec::<String>::new(),
        "additions and reserved removals keep the wire"
    );
    let broken = compiled(&[(
        "a/v1/a.proto",
        r#"syntax = "proto3"; package a.v1;
        message M { string name = 1; int64 term = 2; }
        enum E { E_UNSPECIFIED = 0; E_UNO = 1; }
        service S { rpc Call(M) returns (stream M); }"#,
    )]);
    let problems = breaks(&old, &broken);
    for expected in [
        "field 2 was `term`",
        "field 3 `tags` was removed",
        "value 1 was E_ONE, is E_UNO",
        "value 2 E_TWO was removed",
        "S.Call was removed or changed",
        "S.Watch was removed or changed",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{expected:?} in {problems:#?}"
        );
    }
    assert_eq!(problems.len(), 6, "{problems:#?}");
}
