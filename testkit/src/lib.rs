//! Test support shared by the workspace's tests, so no test file grows its own copy:
//!
//! | module | what |
//! |---|---|
//! | [`wait`] | wait on a condition, bounded: a test that never sees it fails instead of hanging |
//! | [`pki`] | a throwaway CA and the certificates it signs, as PEM or files |
//! | [`fault`] | a TCP path that can be cut (no reset, bytes held) and slowed |
//!
//! A dev-dependency of the service crates and a dependency of `e2e` (the local pool and the
//! scenarios cut links): no production binary links it (`scripts/check-deps.sh` fails if one
//! does).

// Test support fails the test that uses it, with a message, rather than returning errors.
#![allow(clippy::expect_used, clippy::panic)]

pub mod fault;
pub mod pki;
pub mod wait;
