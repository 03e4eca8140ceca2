//! The two counters the pool is fenced by, each its own type so one is never taken for the
//! other: [`OwnershipTerm`] (per route: which member owns an instance; the store's
//! `assignments.term`, the wire's ownership `term`) and [`CoordinatorTerm`] (the lease: which
//! gateway may write; `coordinator_lease.term`, the fence of every coordinator write). Each is
//! the one typed boundary between the wire (`u64`) and the tables (`BIGINT`, read and bound as
//! `i64`).
//!
//! A term is never negative and never above `i64::MAX` (the largest value a `BIGINT`
//! column holds). `0` is a meaningful value ("no term yet": the lease never held, a route
//! never assigned), so nothing here ever defaults to it: a negative column value is a
//! corrupt row ([`super::Error::Corrupt`] through [`super::columns::decoded`]), a value
//! above `i64::MAX` is refused when bound, and a wire value above it is refused by
//! [`OwnershipTerm::from_wire`] and [`CoordinatorTerm::from_wire`].

use std::fmt;

use sqlx::any::{Any, AnyTypeInfo, AnyValueRef};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::{Decode, Encode, Type};

/// A term value outside `0..=i64::MAX`, the range the store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("term {0} is out of range (0..={max})", max = i64::MAX)]
pub struct OutOfRange(pub u64);

/// A term column holds a negative value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("negative term {0}")]
pub struct Negative(pub i64);

macro_rules! term {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(u64);

        impl $name {
            /// No term yet.
            pub const ZERO: $name = $name(0);
            /// The highest term the store can keep (`i64::MAX`).
            pub const MAX: $name = $name(i64::MAX.unsigned_abs());

            /// A term from a value the caller knows is in range (constants, tests). A value above
            /// [`Self::MAX`] is not clamped: binding it to a statement fails with
            /// [`OutOfRange`]. Use [`Self::from_wire`] for a value from a request.
            pub const fn new(value: u64) -> Self {
                $name(value)
            }

            /// A term from the wire: refused (never clamped) above [`Self::MAX`]. RPC handlers answer
            /// the error with `INVALID_ARGUMENT`.
            pub fn from_wire(value: u64) -> Result<Self, OutOfRange> {
                if value > Self::MAX.0 {
                    return Err(OutOfRange(value));
                }
                Ok($name(value))
            }

            /// The value for the wire.
            pub const fn get(self) -> u64 {
                self.0
            }

            /// The term after this one. Saturates at [`Self::MAX`] (2^63 - 1, unreachable in
            /// practice): there the "next" term equals this one, and the store refuses it as a term
            /// that does not grow (a fenced assignment is [`super::Error::Invalid`], a lease term
            /// collides in the term log) instead of wrapping or panicking.
            #[must_use]
            pub fn next(self) -> Self {
                if self.0 >= Self::MAX.0 {
                    Self::MAX
                } else {
                    $name(self.0 + 1)
                }
            }

            /// The term as a metrics gauge value: `i64`, saturating at `i64::MAX` (a term the store
            /// holds always fits; only a hand-made out-of-range [`Self::new`] would saturate).
            pub fn gauge(self) -> i64 {
                i64::try_from(self.0).unwrap_or(i64::MAX)
            }

            fn column(self) -> Result<i64, OutOfRange> {
                i64::try_from(self.0).map_err(|_| OutOfRange(self.0))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<u64> for $name {
            fn from(value: u64) -> Self {
                $name(value)
            }
        }

        impl TryFrom<i64> for $name {
            type Error = Negative;

            fn try_from(value: i64) -> Result<Self, Negative> {
                u64::try_from(value).map($name).map_err(|_| Negative(value))
            }
        }

        impl TryFrom<$name> for i64 {
            type Error = OutOfRange;

            fn try_from(term: $name) -> Result<Self, OutOfRange> {
                term.column()
            }
        }

        impl Type<Any> for $name {
            fn type_info() -> AnyTypeInfo {
                <i64 as Type<Any>>::type_info()
            }
            fn compatible(ty: &AnyTypeInfo) -> bool {
                <i64 as Type<Any>>::compatible(ty)
            }
        }

        impl<'q> Encode<'q, Any> for $name {
            fn encode_by_ref(&self, buf: &mut <Any as sqlx::Database>::ArgumentBuffer<'q>) -> Result<IsNull, BoxDynError> {
                <i64 as Encode<'q, Any>>::encode(self.column()?, buf)
            }
        }

        impl<'r> Decode<'r, Any> for $name {
            fn decode(value: AnyValueRef<'r>) -> Result<Self, BoxDynError> {
                Ok($name::try_from(<i64 as Decode<'r, Any>>::decode(value)?)?)
            }
        }
    };
}

term! {
    /// An ownership term: per route, which member owns the instance. Grows by one with every
    /// change of owner (`assignments.term`; the wire's ownership `term`). `0..=i64::MAX`.
    OwnershipTerm
}

term! {
    /// A coordinator term: which gateway holds the lease and may write the pool's decisions
    /// (`coordinator_lease.term`; the fence of every coordinator write). `0..=i64::MAX`.
    CoordinatorTerm
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn sqlite() -> sqlx::AnyPool {
        sqlx::any::install_default_drivers();
        sqlx::pool::PoolOptions::<Any>::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap()
    }

    #[test]
    fn next_grows_and_saturates() {
        assert_eq!(OwnershipTerm::ZERO.next(), OwnershipTerm::new(1));
        assert_eq!(OwnershipTerm::new(41).next(), OwnershipTerm::new(42));
        assert_eq!(OwnershipTerm::MAX.next(), OwnershipTerm::MAX);
    }

    #[test]
    fn wire_values_above_the_store_range_are_refused() {
        assert_eq!(OwnershipTerm::from_wire(0), Ok(OwnershipTerm::ZERO));
        assert_eq!(
            OwnershipTerm::from_wire(i64::MAX.unsigned_abs()),
            Ok(OwnershipTerm::MAX)
        );
        assert_eq!(
            OwnershipTerm::from_wire(i64::MAX.unsigned_abs() + 1),
            Err(OutOfRange(1 << 63))
        );
        assert_eq!(OwnershipTerm::from_wire(u64::MAX), Err(OutOfRange(u64::MAX)));
        assert_eq!(OwnershipTerm::new(7).get(), 7);
        assert_eq!(OwnershipTerm::new(7).to_string(), "7");
    }

    #[tokio::test]
    async fn a_negative_column_is_refused_on_decode() {
        let pool = sqlite().await;
        let err = sqlx::query_scalar::<_, OwnershipTerm>("SELECT CAST(-1 AS BIGINT)")
            .fetch_one(&pool)
            .await
            .unwrap_err();
        match err {
            sqlx::Error::ColumnDecode { source, .. } => assert_eq!(source.to_string(), "negative term -1"),
            other => panic!("expected a decode error, got {other:?}"),
        }
        let err = crate::store::columns::decoded("assignments")(
            sqlx::query_scalar::<_, OwnershipTerm>("SELECT CAST(-5 AS BIGINT)")
                .fetch_one(&pool)
                .await
                .unwrap_err(),
        );
        assert!(
            matches!(
                err,
                crate::store::Error::Corrupt {
                    table: "assignments",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn terms_round_trip_and_out_of_range_is_refused_on_encode() {
        let pool = sqlite().await;
        let back: OwnershipTerm = sqlx::query_scalar("SELECT $1")
            .bind(OwnershipTerm::MAX)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(back, OwnershipTerm::MAX);
        let back: Option<OwnershipTerm> = sqlx::query_scalar("SELECT $1")
            .bind(None::<OwnershipTerm>)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(back, None);
        let err = sqlx::query_scalar::<_, OwnershipTerm>("SELECT $1")
            .bind(OwnershipTerm::new(u64::MAX))
            .fetch_one(&pool)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    }
}
