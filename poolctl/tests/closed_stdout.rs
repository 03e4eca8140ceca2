//! poolctl as a process whose reader stopped reading (`poolctl … | head`).

#![allow(clippy::expect_used)]

use std::process::{Command, Stdio};

/// stdout is a pipe whose read end is already closed, so every write fails with EPIPE (Rust
/// programs ignore SIGPIPE): the command must end quietly, not panic.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_poolctl"))
        .args(["completions", "bash"])
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .output()
        .expect("poolctl runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "nothing on stderr: {stderr}");
}
