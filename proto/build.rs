//! Generates the gRPC contracts with tonic-prost-build, using the vendored `protoc` so that
//! building never needs a hand-installed one.

use std::path::PathBuf;

/// The contract files, relative to `proto/`. Keep in sync with `src/lib.rs`.
const PROTOS: &[&str] = &[
    "openshell/supervisor/common/v1/common.proto",
    "openshell/supervisor/host/v1/host.proto",
    "openshell/supervisor/runtime/v1/runtime.proto",
    "openshell/supervisor/recovery/v1/recovery.proto",
    "openshell/supervisor/registry/v1/registry.proto",
    "openshell/supervisor/pool/v1/pool.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("proto");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let well_known = protoc_bin_vendored::include_path()?;

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    // Holds a credential's value: its Debug (in `egress.rs`) never shows it.
    config.skip_debug([".openshell.supervisor.runtime.v1.CredentialBinding"]);

    let files: Vec<PathBuf> = PROTOS.iter().map(|p| proto_root.join(p)).collect();
    let includes = [proto_root.clone(), well_known];

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // No generated `XClient::connect(dst)` constructors: runtime.v1's `rpc Connect` would
        // collide with it. Clients are built from a configured channel instead:
        // `XClient::new(Endpoint::from_shared(addr)?.connect().await?)`.
        .build_transport(false)
        .file_descriptor_set_path(out_dir.join("openshell_supervisor_descriptor.bin"))
        .compile_with_config(config, &files, &includes)?;

    println!("cargo:rerun-if-changed={}", proto_root.display());
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    Ok(())
}
