//! Plain records the store reads and writes. Times are Unix milliseconds of
//! the database clock. Records read back whole derive `sqlx::FromRow` (column
//! names are the field names); the enums are text in the tables (see
//! [`super::columns`] for the column types).

use std::fmt;
use std::str::FromStr;

use proto::common::v1::InstancePhase;

use super::columns::{DisplacedColumns, FenceColumns, Flag, PolicyColumns, UnknownText, WithdrawnColumns};
use super::{CoordinatorTerm, OwnershipTerm};

/// A coordinator lease as its holder knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Unique per gateway process.
    pub holder: String,
    /// The coordinator term: strictly increasing across holders.
    pub term: CoordinatorTerm,
    pub expires_at_ms: i64,
}

/// The lease row as read, with the database time of the read.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LeaseView {
    pub holder: String,
    pub term: CoordinatorTerm,
    pub expires_at_ms: i64,
    pub now_ms: i64,
}

impl LeaseView {
    pub fn is_live(&self) -> bool {
        self.expires_at_ms > self.now_ms
    }
}

/// Outcome of an acquire attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    Acquired(Lease),
    /// Someone else holds a live lease.
    HeldBy(LeaseView),
}

/// One granted coordinator term, from the lease log.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TermRecord {
    pub term: CoordinatorTerm,
    pub holder: String,
    pub acquired_at_ms: i64,
    /// When the term's coordinator made its first fenced write.
    pub started_at_ms: Option<i64>,
}

/// The writes only a coordinator makes, each applied by [`super::Store::write_fenced`].
#[derive(Debug, Clone)]
pub enum FencedWrite {
    /// Compare-and-set an assignment: `expected_term: None` means the route
    /// must have no assignment yet; otherwise its term must equal it. The new
    /// term must be higher than the expected one.
    Assign {
        expected_term: Option<OwnershipTerm>,
        next: Assignment,
    },
    /// Remove an assignment whose term is still `expected_term`.
    Unassign {
        route: String,
        expected_term: OwnershipTerm,
    },
    /// Insert or replace a durable operation.
    PutOperation(Operation),
    /// Insert or replace a signing key (rotation, retirement).
    PutSigningKey(SigningKey),
    DeleteSigningKey {
        kid: String,
    },
    /// Forget an ended operation (its retention passed); an open one is never deleted.
    DeleteOperation {
        id: String,
    },
    /// The coordinator's first write of its term: records when it started.
    StartTerm,
    /// Record the owner a route's new reservation displaces (`None`: none).
    Displace {
        route: String,
        displaced: Option<Displaced>,
    },
    /// End the displacement recorded for the route's reservation at `for_term`, which must
    /// still be recorded: an activation of that reservation ended it already, and the batch
    /// fails (a compare-and-set, like `Assign`'s).
    EndDisplacement {
        route: String,
        for_term: OwnershipTerm,
    },
    /// Forget what no decision needs any more, `retention_ms` (database time) after it
    /// retired: replaced workloads (`replaced_instances`), and withdrawn instances without an
    /// assignment with their grants and last report. A route forgotten and registered again
    /// starts at generation 1 and term 1, its old grants gone with it.
    ForgetRetired {
        retention_ms: i64,
    },
}

/// Committed writes to each table the pool view reads in full (see
/// [`Store::pool_writes`](super::Store::pool_writes)): equal counts, unchanged table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolWrites {
    pub instances: i64,
    pub assignments: i64,
    pub reports: i64,
    pub operations: i64,
    /// PostgreSQL: when the server started (Unix ms); counts of another incarnation say
    /// nothing (0 on SQLite).
    pub incarnation: i64,
}

impl PoolWrites {
    /// Whether the store lost writes since `before` was counted: another server incarnation
    /// (PostgreSQL restarted or failed over, which may lose acknowledged commits), or a count
    /// that went down (the store emptied or restored from an older backup).
    pub fn rolled_back_since(&self, before: &Self) -> bool {
        self.incarnation != before.incarnation
            || self.instances < before.instances
            || self.assignments < before.assignments
            || self.reports < before.reports
            || self.operations < before.operations
    }
}

/// What a gateway replica knows of a member stream it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberUpdate {
    pub member: String,
    pub process_id: String,
    pub epoch: i64,
    pub runtime_address: String,
    pub capacity: i64,
    /// The gateway replica serving the stream.
    pub served_by: String,
    pub leaving: bool,
}

/// A member record with its TTL expiry.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct MemberRecord {
    pub member: String,
    pub process_id: String,
    pub epoch: i64,
    pub runtime_address: String,
    pub capacity: i64,
    pub served_by: String,
    #[sqlx(try_from = "Flag")]
    pub leaving: bool,
    pub expires_at_ms: i64,
    pub updated_at_ms: i64,
}

impl MemberRecord {
    pub fn is_live(&self, now_ms: i64) -> bool {
        self.expires_at_ms > now_ms
    }
}

/// Bytes that carry credentials: never printed. A `BLOB`/`BYTEA` column as it is.
#[derive(Clone, PartialEq, Eq, Default, sqlx::Type)]
#[sqlx(transparent)]
pub struct SecretBytes(pub Vec<u8>);

impl fmt::Debug for SecretBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<redacted {} bytes>", self.0.len())
    }
}

/// A desired instance: one running generation of a workload.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct InstanceRecord {
    /// The stable key sidecars and supervisors find each other by.
    pub route: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub generation: i64,
    /// Registration material (carries credentials).
    pub material: SecretBytes,
    pub registered_at_ms: i64,
    /// Withdrawn instances are no longer desired; the row keeps the route's
    /// generation counter.
    #[sqlx(try_from = "Flag")]
    pub withdrawn: bool,
    /// The highest ownership term ever assigned on the route (any generation): the next
    /// placement starts above it.
    pub last_term: OwnershipTerm,
    /// Why it was withdrawn, when that says more than "no longer desired" (`None` for a
    /// deregistration, a Pod gone, or a desired instance).
    #[sqlx(flatten, try_from = "WithdrawnColumns")]
    pub withdrawn_reason: Option<WithdrawnReason>,
    /// The owner the route's current reservation displaced because the gateways lost it,
    /// until an activation (see `gateway::returned`).
    #[sqlx(flatten, try_from = "DisplacedColumns")]
    pub displaced: Option<Displaced>,
    /// The store holds the workload's checkpoint: adopted at its first grant, or given by a
    /// sidecar whose registration recorded the instance anew above its fence (the store had
    /// lost it). A new or revived generation has none until its first grant.
    #[sqlx(try_from = "Flag")]
    pub checkpointed: bool,
    /// The member process that activated the term its sidecar last registered as its fence,
    /// in the sidecar's word (its own route only): whom a store that lost the route gives it
    /// back to (see `gateway::forgotten`).
    #[sqlx(flatten, try_from = "FenceColumns")]
    pub fence_holder: Option<FenceHolder>,
}

/// The member process whose activation set a sidecar's fence, and that term, as the sidecar
/// registered them (`instances.fence_*`; `RegisterRequest.fence_member`, `fence_process_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceHolder {
    pub member: String,
    pub process_id: String,
    pub term: OwnershipTerm,
    /// The instance's generation when it was recorded: a holder of an earlier generation's
    /// term holds nothing of this one.
    pub generation: i64,
}

impl FenceHolder {
    /// Whether this is `member`'s process `process_id` holding `term`.
    pub fn is(&self, term: OwnershipTerm, member: &str, process_id: &str) -> bool {
        self.term == term && self.member == member && self.process_id == process_id
    }
}

/// An owner a recovery displaced because the gateways lost it (`instances.displaced_*`): it
/// may have been cut off from them rather than gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Displaced {
    pub member: String,
    pub process_id: String,
    /// The term it held active.
    pub term: OwnershipTerm,
    /// The term of the reservation that displaced it: any other reservation of the route
    /// (a drain's, a new workload's) says nothing of it.
    pub for_term: OwnershipTerm,
}

/// Why an instance was withdrawn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WithdrawnReason {
    /// Its sidecar stopped the workload at the recovery deadline: no supervisor took it over
    /// in time. `owner` and `term`: the assignment it last had when that was reported (the
    /// sidecar's last activated term when it had none), if known.
    RecoveryFailed {
        owner: Option<String>,
        term: Option<OwnershipTerm>,
    },
}

impl WithdrawnReason {
    /// What `instances.withdrawn_reason` holds for it.
    pub fn kind(&self) -> WithdrawnKind {
        match self {
            Self::RecoveryFailed { .. } => WithdrawnKind::RecoveryFailed,
        }
    }
}

/// The text column `instances.withdrawn_reason`: which [`WithdrawnReason`] a row holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WithdrawnKind {
    RecoveryFailed,
}

/// What a registration asks for: the store assigns the generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub route: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub material: SecretBytes,
}

/// What a registering sidecar knows of its instance, for a store that lost it (emptied, or
/// restored from an older backup) to resume from: the generation it runs, the highest term its
/// fence activated and the workload it supervises. [`Resume::default`]: a new sidecar.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resume {
    /// The generation the sidecar runs (0: it asks for one).
    pub generation: i64,
    /// No term at or below it is ever reserved for the route again.
    pub fence: OwnershipTerm,
    /// Recorded as the instance's checkpoint when the store records the instance anew.
    pub workload: Checkpoint,
    /// The member process that activated `fence`, as the sidecar says (its term is `fence`).
    /// Recorded when `fence` is at or above every term the route used.
    pub holder: Option<(String, String)>,
}

/// Outcome of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registered {
    /// New, re-registered (same uid) or replacing an older workload of the
    /// route at the next generation (which starts without a checkpoint).
    Desired { generation: i64 },
    /// The same workload (uid) was withdrawn before: it cannot come back.
    Withdrawn { generation: i64 },
    /// Another workload (uid) registered the route after this one: it cannot come back.
    Replaced,
    /// The namespace already has `registered` instances, its limit: nothing was stored.
    OverQuota { registered: i64, limit: i64 },
}

/// A recovery grant as the ledger records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantRecord {
    pub route: String,
    pub term: OwnershipTerm,
    pub jti: String,
    pub member: String,
    pub process_id: String,
    /// SHA-256 of the compact grant.
    pub digest: Vec<u8>,
    pub expires_at_ms: i64,
}

/// The workload process an activation vouches for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Checkpoint {
    pub pid: i64,
    pub start_ticks: i64,
    pub exe_digest: Vec<u8>,
}

impl Checkpoint {
    /// The workload a sidecar names on the wire.
    pub fn from_wire(w: &proto::common::v1::WorkloadIdentity) -> Self {
        Self {
            pid: i64::from(w.pid),
            start_ticks: i64::try_from(w.start_time_ticks).unwrap_or(i64::MAX),
            exe_digest: w.exe_digest.clone(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pid == 0 && self.start_ticks == 0 && self.exe_digest.is_empty()
    }
}

/// A receipt's claim that a sidecar fenced for a reserved term: the route's term reserved
/// for `process_id`, the grant minted for it (`jti`, `digest`) and the workload the sidecar
/// vouches for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activation {
    pub route: String,
    pub term: OwnershipTerm,
    /// The calling member (from its credential): the reservation and the grant must be its.
    pub member: String,
    pub process_id: String,
    pub jti: String,
    pub digest: Vec<u8>,
    pub workload: Checkpoint,
}

/// The latest status an owner reported for a route, at a term.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Report {
    pub route: String,
    pub term: OwnershipTerm,
    pub member: String,
    pub process_id: String,
    pub phase: ReportPhase,
    pub message: String,
    pub workload_pid: i64,
    /// The workload's last progress value the owner accepted. `None` in a report whose owner
    /// has accepted none at its term yet (a move's new owner): the store keeps the value
    /// reported for the same workload process before, so a move never shows as a restart.
    /// Always `Some` when read.
    pub progress: Option<i64>,
    /// The gateway replica that attributed it.
    pub reported_by: String,
    /// Set by the store from the database clock.
    pub updated_at_ms: i64,
    /// The egress policy the owner's sidecar last said it enforces in this term.
    #[sqlx(flatten, try_from = "PolicyColumns")]
    pub policy: Option<LoadedPolicy>,
}

/// The sidecar's answer to the owner's policy install (runtime.v1.PolicyLoaded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedPolicy {
    /// The policy in force (empty: none, every destination denied).
    pub name: String,
    pub revision: i64,
    /// Why the last install was not loaded (empty: it was).
    pub error: String,
}

/// What an owner's latest report says of its instance: a wire phase (an unspecified or
/// unknown one read as `Failed`, as the contract says), or `Absent` when the owner reconciled
/// past the term without hosting the route. Stored as the wire name (`INSTANCE_PHASE_ACTIVE`,
/// …) or `ABSENT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportPhase {
    Starting,
    Active,
    Recovering,
    Relinquished,
    Stopped,
    Failed,
    Absent,
}

impl ReportPhase {
    /// The phase of a wire value.
    pub fn of(phase: InstancePhase) -> Self {
        match phase {
            InstancePhase::Starting => Self::Starting,
            InstancePhase::Active => Self::Active,
            InstancePhase::Recovering => Self::Recovering,
            InstancePhase::Relinquished => Self::Relinquished,
            InstancePhase::Stopped => Self::Stopped,
            InstancePhase::Failed | InstancePhase::Unspecified => Self::Failed,
        }
    }

    /// The wire phase; `None` for `Absent`.
    pub fn wire(self) -> Option<InstancePhase> {
        Some(match self {
            Self::Starting => InstancePhase::Starting,
            Self::Active => InstancePhase::Active,
            Self::Recovering => InstancePhase::Recovering,
            Self::Relinquished => InstancePhase::Relinquished,
            Self::Stopped => InstancePhase::Stopped,
            Self::Failed => InstancePhase::Failed,
            Self::Absent => return None,
        })
    }

    /// The owner hosts the instance (it is taking it on or holds it).
    pub fn hosts(self) -> bool {
        matches!(self, Self::Starting | Self::Active)
    }

    /// The owner will not host the instance at this term (it failed, or never took it on).
    pub fn lost(self) -> bool {
        matches!(self, Self::Failed | Self::Absent)
    }
}

/// Where an assignment is in its handover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssignmentPhase {
    /// The term is reserved for a candidate that has not activated it yet.
    Reserved,
    /// The owner presented a receipt and the gateway activated the term.
    Active,
}

/// The owner of one instance at one ownership term.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Assignment {
    pub route: String,
    pub member: String,
    pub process_id: String,
    /// Ownership term: strictly increasing per route, the runtime fencing token.
    pub term: OwnershipTerm,
    pub phase: AssignmentPhase,
    /// The instance generation it was made for: an older one than the route's registered
    /// generation means another workload replaced it, and the assignment is stale.
    pub generation: i64,
    /// The term at which this generation was placed (later terms are recoveries or moves).
    pub placed_term: OwnershipTerm,
    /// Coordinator term that wrote it (set by the store).
    pub coordinator_term: CoordinatorTerm,
    /// Set by the store from the database clock.
    pub updated_at_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationKind {
    Assign,
    Recover,
    Drain,
    Rebalance,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationPhase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl OperationPhase {
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// A durable coordinator operation; a new coordinator adopts pending ones.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Operation {
    pub id: String,
    pub kind: OperationKind,
    /// A member for drain, a route for assign/recover, empty for rebalance.
    pub target: String,
    pub phase: OperationPhase,
    pub message: String,
    pub attempts: i64,
    pub moves: i64,
    /// Absolute deadline; adopting coordinators never extend it.
    pub deadline_at_ms: Option<i64>,
    pub max_parallel: i64,
    pub requested_by: String,
    /// An operator asked to cancel it; the coordinator applies that.
    #[sqlx(try_from = "Flag")]
    pub cancel_requested: bool,
    /// Set by the store on first insert from the database clock.
    pub created_at_ms: i64,
    /// Set by the store on every write from the database clock.
    pub updated_at_ms: i64,
}

/// A gateway signing key. The private half never leaves the store and the
/// gateway's memory, and is never printed.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SigningKey {
    pub kid: String,
    pub algorithm: String,
    /// Public key, PEM.
    pub public_pem: String,
    /// Private key, PEM.
    pub private_pem: SecretBytes,
    pub created_at_ms: i64,
    /// Tokens are signed with the newest key not retired.
    pub retired_at_ms: Option<i64>,
}

/// Text forms stored in the tables, shared by both backends; the column types
/// themselves (read and bound as text) are in [`super::columns`].
macro_rules! text_enum {
    ($ty:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }
        impl FromStr for $ty {
            type Err = UnknownText;
            fn from_str(s: &str) -> Result<Self, UnknownText> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    other => Err(UnknownText { kind: stringify!($ty), text: other.to_owned() }),
                }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        super::columns::text_column!($ty);
    };
}

text_enum!(AssignmentPhase { Reserved => "reserved", Active => "active" });
text_enum!(ReportPhase {
    Starting => "INSTANCE_PHASE_STARTING",
    Active => "INSTANCE_PHASE_ACTIVE",
    Recovering => "INSTANCE_PHASE_RECOVERING",
    Relinquished => "INSTANCE_PHASE_RELINQUISHED",
    Stopped => "INSTANCE_PHASE_STOPPED",
    Failed => "INSTANCE_PHASE_FAILED",
    Absent => "ABSENT",
});
text_enum!(OperationKind { Assign => "assign", Recover => "recover", Drain => "drain", Rebalance => "rebalance" });
text_enum!(WithdrawnKind { RecoveryFailed => "recovery_failed" });
text_enum!(OperationPhase {
    Pending => "pending",
    Running => "running",
    Succeeded => "succeeded",
    Failed => "failed",
    Cancelled => "cancelled",
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_phases_are_stored_as_their_wire_names() {
        for value in 0..=7 {
            let wire = InstancePhase::from_wire(value);
            let phase = ReportPhase::of(wire);
            assert_eq!(phase.as_str(), wire.as_str_name(), "{value}");
            assert_eq!(phase.as_str().parse::<ReportPhase>(), Ok(phase));
            assert_eq!(phase.wire(), Some(wire));
        }
        assert_eq!(ReportPhase::of(InstancePhase::Unspecified), ReportPhase::Failed);
        assert_eq!("ABSENT".parse::<ReportPhase>(), Ok(ReportPhase::Absent));
        assert_eq!(ReportPhase::Absent.wire(), None);
        assert!("INSTANCE_PHASE_UNSPECIFIED".parse::<ReportPhase>().is_err());
    }

    #[test]
    fn secrets_are_not_printed() {
        let key = SigningKey {
            kid: "k1".into(),
            algorithm: "EdDSA".into(),
            public_pem: "pub".into(),
            private_pem: SecretBytes(b"-----BEGIN PRIVATE KEY----- topsecret".to_vec()),
            created_at_ms: 0,
            retired_at_ms: None,
        };
        let shown = format!("{key:?}");
        assert!(!shown.contains("topsecret"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn enum_text_round_trips() {
        for phase in [OperationPhase::Pending, OperationPhase::Cancelled] {
            assert_eq!(phase.as_str().parse::<OperationPhase>(), Ok(phase));
        }
        assert!("bogus".parse::<OperationKind>().is_err());
    }
}
