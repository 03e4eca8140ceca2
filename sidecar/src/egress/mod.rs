//! Egress: the sidecar is the workload's way out. [`policy`] is the installed revision and its
//! decisions, [`floor`] what no revision opens, [`proxy`] the forward proxy that applies both.
//! The revision comes from the activated owner (`PolicyInstall` on the runtime stream, fenced
//! by the term like every control message) and is kept in the sidecar's persisted state, so
//! decisions go on unchanged while the owner changes.

pub mod floor;
pub mod policy;
pub mod proxy;

pub use floor::Floor;
pub use policy::Policy;
pub use proxy::{Egress, Limits};
