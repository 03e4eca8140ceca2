//! Column types at the row boundary, shared by both backends through sqlx's `Any`
//! driver: the store's enums as text columns (read, with a clear error for an unknown
//! value, and bound as they are), flags (`Any` cannot read SQLite's `BOOLEAN`, so the
//! queries select `CASE WHEN … THEN 1 ELSE 0 END`), the withdrawal columns, and the
//! mapping of a value that does not decode to [`Error::Corrupt`].

use sqlx::any::{Any, AnyTypeInfo, AnyValueRef};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::{Decode, Encode, Type};

use super::{Displaced, Error, FenceHolder, LoadedPolicy, OwnershipTerm, WithdrawnKind, WithdrawnReason};

/// A text column holds a value its enum does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {text:?}")]
pub struct UnknownText {
    /// The enum the column maps to.
    pub kind: &'static str,
    pub text: String,
}

/// An integer flag column (`0` false, anything else true).
#[derive(Debug, Clone, Copy, sqlx::Type)]
#[sqlx(transparent)]
pub struct Flag(i64);

impl From<Flag> for bool {
    fn from(flag: Flag) -> Self {
        flag.0 != 0
    }
}

/// `instances.withdrawn_reason` with the columns that go with it. An unknown reason fails
/// as its column is read (a `try_from` of a flattened row loses the error's text).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WithdrawnColumns {
    withdrawn_reason: Option<WithdrawnKind>,
    withdrawn_owner: Option<String>,
    withdrawn_term: Option<OwnershipTerm>,
}

impl From<WithdrawnColumns> for Option<WithdrawnReason> {
    fn from(c: WithdrawnColumns) -> Self {
        c.withdrawn_reason.map(|kind| match kind {
            WithdrawnKind::RecoveryFailed => WithdrawnReason::RecoveryFailed {
                owner: c.withdrawn_owner,
                term: c.withdrawn_term,
            },
        })
    }
}

/// `instances.displaced_*`: all NULL, or all set (a partial row reads as none).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DisplacedColumns {
    displaced_member: Option<String>,
    displaced_process_id: Option<String>,
    displaced_term: Option<OwnershipTerm>,
    displaced_for: Option<OwnershipTerm>,
}

impl From<DisplacedColumns> for Option<Displaced> {
    fn from(c: DisplacedColumns) -> Self {
        Some(Displaced {
            member: c.displaced_member?,
            process_id: c.displaced_process_id?,
            term: c.displaced_term?,
            for_term: c.displaced_for?,
        })
    }
}

/// `instances.fence_*`: all NULL, or all set (a partial row reads as none).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FenceColumns {
    fence_member: Option<String>,
    fence_process_id: Option<String>,
    fence_term: Option<OwnershipTerm>,
    fence_generation: Option<i64>,
}

impl From<FenceColumns> for Option<FenceHolder> {
    fn from(c: FenceColumns) -> Self {
        Some(FenceHolder {
            member: c.fence_member?,
            process_id: c.fence_process_id?,
            term: c.fence_term?,
            generation: c.fence_generation?,
        })
    }
}

/// `instance_reports.policy_*`: all NULL when no answer was reported.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PolicyColumns {
    policy_name: Option<String>,
    policy_revision: Option<i64>,
    policy_error: Option<String>,
}

impl From<PolicyColumns> for Option<LoadedPolicy> {
    fn from(c: PolicyColumns) -> Self {
        c.policy_name.map(|name| LoadedPolicy {
            name,
            revision: c.policy_revision.unwrap_or(0),
            error: c.policy_error.unwrap_or_default(),
        })
    }
}

/// `map_err` for reads of `table`: a value that does not decode is a corrupt record.
pub(super) fn decoded(table: &'static str) -> impl FnOnce(sqlx::Error) -> Error {
    move |err| match err {
        sqlx::Error::ColumnDecode { index, source } => Error::Corrupt {
            table,
            detail: format!("column {index}: {source}"),
        },
        other => Error::Database(other),
    }
}

/// Text column impls for an enum with `as_str` and `FromStr<Err = UnknownText>`.
macro_rules! text_column {
    ($ty:ident) => {
        impl ::sqlx::Type<::sqlx::Any> for $ty {
            fn type_info() -> ::sqlx::any::AnyTypeInfo {
                $crate::store::columns::text_type_info()
            }
            fn compatible(ty: &::sqlx::any::AnyTypeInfo) -> bool {
                $crate::store::columns::text_compatible(ty)
            }
        }
        impl<'q> ::sqlx::Encode<'q, ::sqlx::Any> for $ty {
            fn encode_by_ref(
                &self,
                buf: &mut <::sqlx::Any as ::sqlx::Database>::ArgumentBuffer<'q>,
            ) -> ::std::result::Result<::sqlx::encode::IsNull, ::sqlx::error::BoxDynError> {
                $crate::store::columns::encode_text(self.as_str(), buf)
            }
        }
        impl<'r> ::sqlx::Decode<'r, ::sqlx::Any> for $ty {
            fn decode(value: ::sqlx::any::AnyValueRef<'r>) -> ::std::result::Result<Self, ::sqlx::error::BoxDynError> {
                Ok($crate::store::columns::decode_text(value)?.parse::<$ty>()?)
            }
        }
    };
}
pub(super) use text_column;

pub fn text_type_info() -> AnyTypeInfo {
    <str as Type<Any>>::type_info()
}

pub fn text_compatible(ty: &AnyTypeInfo) -> bool {
    <str as Type<Any>>::compatible(ty)
}

pub fn encode_text<'q>(
    text: &'static str,
    buf: &mut <Any as sqlx::Database>::ArgumentBuffer<'q>,
) -> Result<IsNull, BoxDynError> {
    <&str as Encode<'q, Any>>::encode(text, buf)
}

pub fn decode_text(value: AnyValueRef<'_>) -> Result<String, BoxDynError> {
    <String as Decode<'_, Any>>::decode(value)
}
