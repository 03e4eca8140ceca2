//! [`Term`]: an ownership term (per route) or a coordinator lease term, the one typed
//! boundary between the wire (`u64`) and the tables (`BIGINT`, read and bound as `i64`).
//!
//! A term is never negative and never above `i64::MAX` (the largest value a `BIGINT`
//! column holds). `0` is a meaningful value ("no term yet": the lease never held, a route
//! never assigned), so nothing here ever defaults to it: a negative column value is a
//! corrupt row ([`super::Error::Corrupt`] through [`super::columns::decoded`]), a value
//! above `i64::MAX` is refused when bound, and a wire value above it is refused by
//! [`Term::from_wire`].

use std::fmt;

use sqlx::any::{Any, AnyTypeInfo, AnyValueRef};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::{Decode, Encode, Type};

/// An ownership or coordinator term: `0..=i64::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Term(u64);

/// A term value outside `0..=i64::MAX`, the range the store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("term {0} is out of range (0..={max})", max = i64::MAX)]
pub struct OutOfRange(pub u64);

/// A term column holds a negative value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("negative term {0}")]
pub struct Negative(pub i64);

impl Term {
    /// No term yet.
    pub const ZERO: Term = Term(0);
    /// The highest term the store can keep (`i64::MAX`).
    pub const MAX: Term = Term(i64::MAX.unsigned_abs());

    /// A term from a value the caller knows is in range (constants, tests). A value above
    /// [`Term::MAX`] is not clamped: binding it to a statement fails with
    /// [`OutOfRange`]. Use [`Term::from_wire`] for a value from a request.
    pub const fn new(value: u64) -> Self {
        Term(value)
    }

    /// A term from the wire: refused (never clamped) above [`Term::MAX`]. RPC handlers answer
    /// the error with `INVALID_ARGUMENT`.
    pub fn from_wire(value: u64) -> Result<Self, OutOfRange> {
        if value > Self::MAX.0 {
            return Err(OutOfRange(value));
        }
        Ok(Term(value))
    }

    /// The value for the wire.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The term after this one. Saturates at [`Term::MAX`] (2^63 - 1, unreachable in
    /// practice): there the "next" term equals this one, and the store refuses it as a term
    /// that does not grow (a fenced assignment is [`super::Error::Invalid`], a lease term
    /// collides in the term log) instead of wrapping or panicking.
    #[must_use]
    pub fn next(self) -> Self {
        if self.0 >= Self::MAX.0 {
            Self::MAX
        } else {
            Term(self.0 + 1)
        }
    }

    /// The term as a metrics gauge value: `i64`, saturating at `i64::MAX` (a term the store
    /// holds always fits; only a hand-made out-of-range [`Term::new`] would saturate).
    pub fn gauge(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }

    fn column(self) -> Result<i64, OutOfRange> {
        i64::try_from(self.0).map_err(|_| OutOfRange(self.0))
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<u64> for Term {
    fn from(value: u64) -> Self {
        Term(value)
    }
}

impl TryFrom<i64> for Term {
    type Error = Negative;

    fn try_from(value: i64) -> Result<Self, Negative> {
        u64::try_from(value).map(Term).map_err(|_| Negative(value))
    }
}

impl TryFrom<Term> for i64 {
    type Error = OutOfRange;

    fn try_from(term: Term) -> Result<Self, OutOfRange> {
        term.column()
    }
}

impl Type<Any> for Term {
    fn type_info() -> AnyTypeInfo {
        <i64 as Type<Any>>::type_info()
    }
    fn compatible(ty: &AnyTypeInfo) -> bool {
        <i64 as Type<Any>>::compatible(ty)
    }
}

impl<'q> Encode<'q, Any> for Term {
    fn encode_by_ref(&self, buf: &mut <Any as sqlx::Database>::ArgumentBuffer<'q>) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<'q, Any>>::encode(self.column()?, buf)
    }
}

impl<'r> Decode<'r, Any> for Term {
    fn decode(value: AnyValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(Term::try_from(<i64 as Decode<'r, Any>>::decode(value)?)?)
    }
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
        assert_eq!(Term::ZERO.next(), Term::new(1));
        assert_eq!(Term::new(41).next(), Term::new(42));
        assert_eq!(Term::MAX.next(), Term::MAX);
    }

    #[test]
    fn wire_values_above_the_store_range_are_refused() {
        assert_eq!(Term::from_wire(0), Ok(Term::ZERO));
        assert_eq!(Term::from_wire(i64::MAX.unsigned_abs()), Ok(Term::MAX));
        assert_eq!(Term::from_wire(i64::MAX.unsigned_abs() + 1), Err(OutOfRange(1 << 63)));
        assert_eq!(Term::from_wire(u64::MAX), Err(OutOfRange(u64::MAX)));
        assert_eq!(Term::new(7).get(), 7);
        assert_eq!(Term::new(7).to_string(), "7");
    }

    #[tokio::test]
    async fn a_negative_column_is_refused_on_decode() {
        let pool = sqlite().await;
        let err = sqlx::query_scalar::<_, Term>("SELECT CAST(-1 AS BIGINT)")
            .fetch_one(&pool)
            .await
            .unwrap_err();
        match err {
            sqlx::Error::ColumnDecode { source, .. } => assert_eq!(source.to_string(), "negative term -1"),
            other => panic!("expected a decode error, got {other:?}"),
        }
        let err = crate::store::columns::decoded("assignments")(
            sqlx::query_scalar::<_, Term>("SELECT CAST(-5 AS BIGINT)")
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
        let back: Term = sqlx::query_scalar("SELECT $1")
            .bind(Term::MAX)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(back, Term::MAX);
        let back: Option<Term> = sqlx::query_scalar("SELECT $1")
            .bind(None::<Term>)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(back, None);
        let err = sqlx::query_scalar::<_, Term>("SELECT $1")
            .bind(Term::new(u64::MAX))
            .fetch_one(&pool)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    }
}
