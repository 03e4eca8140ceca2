//! The engine: the single place that owns the fence, every runtime stream, the relay and the
//! recovery clock, and takes every decision. Streams (`runtime_link`), the workload endpoint
//! (`workload`), the registration and the process watcher are separate tasks that only report
//! to it.
//!
//! Split sans-I/O: `machine` (with `control`, `relay` and `stop`) decides — `Machine::on(now, event)`
//! returns effects and touches no file, socket, task or clock; `driver` runs it, turning
//! inputs into `effect::Event`s and carrying out the `effect::Effect`s.
//!
//! Modes: `Unregistered` (waiting for the registry's generation) → `Placing` (first placement:
//! Attach with fence 0, bounded by the registry's deadline) → `Active` (an activated owner's
//! stream relays) ⇄ `Recovering` (owner lost or relinquished: frozen, RecoveryHello under the
//! episode's budget until a term is activated or the deadline passes) → `Stopping` (release,
//! missed deadline, workload exit or shutdown: the workload is stopped, nothing else is
//! accepted).

mod audit;
mod control;
mod driver;
mod effect;
mod machine;
mod relay;
mod stop;
#[cfg(test)]
mod tests;

pub(crate) use driver::{Driver, EgressLink, Inputs, Pinned};
