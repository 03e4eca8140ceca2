//! Waiting on a condition rather than sleeping: [`until`] polls until the condition holds and
//! fails the test, naming what it waited for, when `limit` passes first. The limit bounds a
//! hang; it is not a timing assertion.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often [`until`] asks again.
pub const POLL: Duration = Duration::from_millis(10);

/// Polls `check` every [`POLL`] until it returns `Some`, and returns that; panics with `what`
/// once `limit` has passed.
pub async fn until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "gave up after {limit:?} waiting for {what}");
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_what_the_condition_found() {
        let mut asked = 0;
        let found = until("the third ask", Duration::from_secs(5), || {
            asked += 1;
            let now = asked;
            async move { (now == 3).then_some(now) }
        })
        .await;
        assert_eq!(found, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "gave up after 50ms waiting for nothing")]
    async fn a_condition_that_never_holds_fails_the_test() {
        until("nothing", Duration::from_millis(50), || async { None::<()> }).await;
    }
}
