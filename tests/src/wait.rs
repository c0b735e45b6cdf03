//! Waiting on conditions with a deadline.

use futures::{Stream, StreamExt};
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// How often [`wait_for`] and [`wait_for_some`] re-check their condition.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Re-checks `condition` every [`POLL_INTERVAL`] until it is true; panics naming `what`
/// when `timeout` passes first.
///
/// ```no_run
/// # use std::time::Duration;
/// # async fn example(bus: slotpool_protocol::connect::Bus) {
/// use slotpool_protocol::model::Node;
/// slotpool_tests::wait_for("slot bn-1.0 taken", Duration::from_secs(5), || async {
///     bus.slots.get::<Node>("bn-1.0").await.unwrap().is_some()
/// })
/// .await;
/// # }
/// ```
pub async fn wait_for<F, Fut>(what: impl Display, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for_some(what, timeout, || {
        let check = condition();
        async move { check.await.then_some(()) }
    })
    .await
}

/// Re-checks `probe` every [`POLL_INTERVAL`] until it returns `Some`, and returns that
/// value; panics naming `what` when `timeout` passes first.
pub async fn wait_for_some<T, F, Fut>(what: impl Display, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    let deadline = start + timeout;
    loop {
        // A probe that hangs must not outlive the deadline either.
        match tokio::time::timeout_at(deadline, probe()).await {
            Ok(Some(value)) => return value,
            Ok(None) => {}
            Err(_) => break,
        }
        if Instant::now() + POLL_INTERVAL > deadline {
            break;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
    panic!("timed out after {:?} waiting for {what}", start.elapsed());
}

/// The next item of `stream`; panics naming `what` when none arrives within `timeout` or
/// the stream ends.
pub async fn next_within<S>(stream: &mut S, timeout: Duration, what: impl Display) -> S::Item
where
    S: Stream + Unpin,
{
    match tokio::time::timeout(timeout, stream.next()).await {
        Ok(Some(item)) => item,
        Ok(None) => panic!("stream ended while waiting for {what}"),
        Err(_) => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn wait_for_returns_once_true() {
        let calls = AtomicU32::new(0);
        wait_for("third call", Duration::from_secs(5), || async {
            calls.fetch_add(1, Ordering::SeqCst) >= 2
        })
        .await;
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for the impossible")]
    async fn wait_for_panics_with_what() {
        wait_for("the impossible", Duration::from_millis(50), || async {
            false
        })
        .await;
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for a hung probe")]
    async fn wait_for_some_bounds_a_hung_probe() {
        wait_for_some::<(), _, _>("a hung probe", Duration::from_millis(50), || {
            std::future::pending()
        })
        .await;
    }

    #[tokio::test]
    async fn next_within_yields_items() {
        let mut s = futures::stream::iter([1, 2]);
        assert_eq!(next_within(&mut s, Duration::from_secs(1), "one").await, 1);
    }
}
