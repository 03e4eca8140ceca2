//! End-to-end harness: the project's binaries as real local processes on
//! loopback with the embedded SQLite store (or a PostgreSQL URL).
//!
//! - [`process`]: one child process with its log file and signals;
//! - [`local`]: a local pool — gateway replicas and supervisor members — and
//!   its status over the operator API;
//! - [`chaos`]: randomized faults and the history checker (`scenarios chaos`);
//! - [`postgres`]: a private PostgreSQL server the harness can stop and start;
//! - [`scale`]: simulated members over real gRPC and many registrations (`scenarios scale`);
//! - [`flood`]: the connection flood probe with its measurements;
//! - [`cli`]: what the binaries run (`scenarios`, `local-pool`), each `main` only parsing;
//! - [`agent`]: the sample workload; [`probe`]: the cluster test's attacker;
//! - [`cluster`]: a real cluster through `kubectl`, for the cluster test (`scripts/test-cluster`).

pub mod agent;
pub mod agent_log;
pub mod chaos;
pub mod cli;
pub mod cluster;
pub mod egress;
pub mod flood;
pub mod local;
pub mod postgres;
pub mod probe;
pub mod process;
pub mod scale;
pub mod scenarios;
