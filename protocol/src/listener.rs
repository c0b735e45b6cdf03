//! Bounds every slotpool listener keeps (`slotpool serve --http`, `slotpool-agent
//! --metrics`, the agent's placement socket): a connection limit, a deadline on idle
//! connections, and accept errors that pause the loop and are logged at a bounded rate.
//!
//! Without them one local user holding a thousand idle connections takes every file
//! descriptor of the process, and an accept loop that retries at once on `EMFILE` logs
//! each failure: hundreds of MiB of log a minute.
//!
//! A full HTTP listener makes room rather than make newcomers wait ([`Gate::admit`]):
//! the newest connection is taken and the oldest one that is not being answered is
//! closed. A flood of idle connections so only ever pushes out itself (and idle
//! kept-alive clients, who reconnect), while a client that sends its request at once is
//! answered: it would have to be overtaken by a whole limit's worth of newer
//! connections before its request head arrived.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

/// How long an accept loop rests after an accept error (`EMFILE`, `ENFILE`, `ENOMEM`):
/// the condition lasts until connections close, and retrying at once only spins.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// At most one warning about a listener's trouble (accept errors, the connection limit
/// reached) in this long; the next one says how many were not logged.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// What a listener admits: at most `max_connections` at once, each closed after `idle`
/// without a byte read or written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub max_connections: usize,
    pub idle: Duration,
}

/// A listener's gate: keeps the open connections within its bounds (see
/// [`Gate::admit`]) and paces its warnings.
#[derive(Clone)]
pub struct Gate {
    name: &'static str,
    bounds: Bounds,
    open: Arc<Mutex<Open>>,
    errors: Arc<AcceptErrors>,
    full: Arc<Throttle>,
}

#[derive(Default)]
struct Open {
    next: u64,
    /// By age (ids only grow): whether each is being answered, and how to close it.
    connections: BTreeMap<u64, Slot>,
}

struct Slot {
    busy: usize,
    close: CancellationToken,
}

/// One admitted connection. Dropping it (the connection ended) frees its place.
pub struct Admitted {
    id: u64,
    open: Arc<Mutex<Open>>,
    close: CancellationToken,
}

/// The connection is being answered (a request in progress, a change stream running):
/// it is not closed to make room until this is dropped.
pub struct Busy {
    id: u64,
    open: Arc<Mutex<Open>>,
}

impl Gate {
    /// A gate for the listener called `name` in its log lines.
    pub fn new(name: &'static str, bounds: Bounds) -> Gate {
        Gate {
            name,
            bounds,
            open: Arc::default(),
            errors: Arc::new(AcceptErrors::new(name)),
            full: Arc::new(Throttle::new(1, WARN_EVERY)),
        }
    }

    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// Admits a connection just accepted. At the limit, the oldest connection not being
    /// answered is told to close ([`Admitted::closed`]) to make room; when every one is
    /// being answered, the newcomer is refused (`None`: drop it). Either is logged at
    /// most once per [`WARN_EVERY`].
    pub fn admit(&self) -> Option<Admitted> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.connections.len() >= self.bounds.max_connections.max(1) {
            let oldest_idle = open
                .connections
                .iter()
                .find(|(_, slot)| slot.busy == 0)
                .map(|(id, _)| *id);
            let made_room = match oldest_idle {
                Some(id) => {
                    if let Some(slot) = open.connections.remove(&id) {
                        slot.close.cancel();
                    }
                    true
                }
                None => false,
            };
            if let Some(quiet) = self.full.take(Instant::now()) {
                tracing::warn!(
                    listener = self.name,
                    max_connections = self.bounds.max_connections,
                    not_logged = quiet,
                    "{}: {} connections open; {}",
                    self.name,
                    self.bounds.max_connections,
                    if made_room {
                        "closed the oldest idle one"
                    } else {
                        "all are being answered, refused a new one"
                    }
                );
            }
            if !made_room {
                return None;
            }
        }
        let id = open.next;
        open.next += 1;
        let close = CancellationToken::new();
        open.connections.insert(
            id,
            Slot {
                busy: 0,
                close: close.clone(),
            },
        );
        Some(Admitted {
            id,
            open: self.open.clone(),
            close,
        })
    }

    /// How many connections are open now.
    pub fn open(&self) -> usize {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .connections
            .len()
    }

    /// After a failed accept: see [`AcceptErrors::failed`].
    pub async fn accept_failed(&self, err: &io::Error) {
        self.errors.failed(err).await;
    }

    /// Wraps `io` so that [`IdleWatch::expired`] ends once nothing moved on it for the
    /// gate's idle time.
    pub fn watch<S>(&self, io: S) -> (Idle<S>, IdleWatch) {
        Idle::new(io, self.bounds.idle)
    }
}

impl Admitted {
    /// Completes when the gate closes this connection to make room.
    pub fn closed(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.close.clone().cancelled_owned()
    }

    /// Marks the connection as being answered until the guard is dropped.
    pub fn busy(&self) -> Busy {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = open.connections.get_mut(&self.id) {
            slot.busy += 1;
        }
        Busy {
            id: self.id,
            open: self.open.clone(),
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.connections.remove(&self.id);
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = open.connections.get_mut(&self.id) {
            slot.busy = slot.busy.saturating_sub(1);
        }
    }
}

/// An accept loop's errors: each pauses the loop for [`ACCEPT_PAUSE`], and at most one
/// is logged per [`WARN_EVERY`].
pub struct AcceptErrors {
    name: &'static str,
    logged: Throttle,
}

impl AcceptErrors {
    pub fn new(name: &'static str) -> AcceptErrors {
        AcceptErrors {
            name,
            logged: Throttle::new(1, WARN_EVERY),
        }
    }

    /// After a failed accept: logs it (at most once per [`WARN_EVERY`]) and rests for
    /// [`ACCEPT_PAUSE`].
    pub async fn failed(&self, err: &io::Error) {
        if let Some(quiet) = self.logged.take(Instant::now()) {
            tracing::warn!(
                listener = self.name,
                %err,
                not_logged = quiet,
                "{}: cannot accept a connection; pausing {ACCEPT_PAUSE:?}",
                self.name
            );
        }
        tokio::time::sleep(ACCEPT_PAUSE).await;
    }
}

/// A token bucket for log lines: `burst` lines at once, then one per `every / burst`;
/// [`Throttle::take`] says how many were held back since the last line let through.
pub struct Throttle {
    burst: u32,
    every: Duration,
    state: Mutex<ThrottleState>,
}

struct ThrottleState {
    tokens: f64,
    at: Option<Instant>,
    quiet: u64,
}

impl Throttle {
    pub fn new(burst: u32, every: Duration) -> Throttle {
        Throttle {
            burst: burst.max(1),
            every,
            state: Mutex::new(ThrottleState {
                tokens: f64::from(burst.max(1)),
                at: None,
                quiet: 0,
            }),
        }
    }

    /// `Some(held back)` when a line may be written now, with how many were held back
    /// since the last one; `None` when this one is to be held back (and counted).
    pub fn take(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = s.at {
            let per_token = self.every.as_secs_f64() / f64::from(self.burst);
            let earned = now.saturating_duration_since(at).as_secs_f64() / per_token;
            s.tokens = (s.tokens + earned).min(f64::from(self.burst));
        }
        s.at = Some(now);
        if s.tokens >= 1.0 {
            s.tokens -= 1.0;
            Some(std::mem::take(&mut s.quiet))
        } else {
            s.quiet += 1;
            None
        }
    }
}

/// An I/O object that notes when a byte last moved, for [`IdleWatch`].
pub struct Idle<S> {
    io: S,
    clock: Arc<Activity>,
}

/// Ends (see [`IdleWatch::expired`]) once its connection has been idle for its limit.
pub struct IdleWatch {
    clock: Arc<Activity>,
    limit: Duration,
}

struct Activity {
    start: tokio::time::Instant,
    /// Milliseconds after `start` of the last read or write that moved bytes.
    last_ms: AtomicU64,
}

impl Activity {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> tokio::time::Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

impl<S> Idle<S> {
    fn new(io: S, limit: Duration) -> (Idle<S>, IdleWatch) {
        let clock = Arc::new(Activity {
            start: tokio::time::Instant::now(),
            last_ms: AtomicU64::new(0),
        });
        (
            Idle {
                io,
                clock: clock.clone(),
            },
            IdleWatch { clock, limit },
        )
    }
}

impl IdleWatch {
    /// Completes once no byte has moved for the limit; sleeps meanwhile (one timer,
    /// re-armed only when it fires).
    pub fn expired(&self) -> impl Future<Output = ()> + Send + 'static {
        let clock = self.clock.clone();
        let limit = self.limit;
        async move {
            loop {
                let due = clock.last() + limit;
                if tokio::time::Instant::now() >= due {
                    return;
                }
                tokio::time::sleep_until(due).await;
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Idle<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.clock.touch();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Idle<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.clock.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.clock.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn a_throttle_lets_a_burst_through_then_counts_what_it_holds_back() {
        let t = Throttle::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(t.take(t0), Some(0));
        assert_eq!(t.take(t0), Some(0));
        assert_eq!(t.take(t0), None);
        assert_eq!(t.take(t0 + Duration::from_secs(1)), None);
        // One token every 5 s: the next line says two were held back.
        assert_eq!(t.take(t0 + Duration::from_secs(5)), Some(2));
        assert_eq!(t.take(t0 + Duration::from_secs(6)), None);
        // A long quiet refills the burst, no more.
        let later = t0 + Duration::from_secs(600);
        assert_eq!(t.take(later), Some(1));
        assert_eq!(t.take(later), Some(0));
        assert_eq!(t.take(later), None);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_expires_and_traffic_defers_it() {
        let (a, mut b) = tokio::io::duplex(64);
        let (mut a, watch) = Idle::new(a, Duration::from_secs(30));
        let expired = watch.expired();
        tokio::pin!(expired);
        // Traffic every 20 s keeps it open.
        for _ in 0..3 {
            tokio::select! {
                _ = &mut expired => panic!("expired while in use"),
                _ = tokio::time::sleep(Duration::from_secs(20)) => {}
            }
            b.write_all(b"x").await.unwrap();
            let mut one = [0u8; 1];
            a.read_exact(&mut one).await.unwrap();
        }
        let quiet_from = tokio::time::Instant::now();
        expired.await;
        let waited = quiet_from.elapsed();
        assert!(
            waited >= Duration::from_secs(29) && waited <= Duration::from_secs(31),
            "{waited:?}"
        );
    }

    #[test]
    fn a_full_gate_closes_its_oldest_idle_connection_and_never_a_busy_one() {
        let gate = Gate::new(
            "test",
            Bounds {
                max_connections: 2,
                idle: Duration::from_secs(1),
            },
        );
        let first = gate.admit().unwrap();
        let second = gate.admit().unwrap();
        let answering = first.busy();
        // Full: the oldest idle one (the second: the first is being answered) goes.
        let third = gate.admit().unwrap();
        assert!(second.closed().now_or_never().is_some());
        assert!(first.closed().now_or_never().is_none());
        assert_eq!(gate.open(), 2);
        drop(second);
        assert_eq!(
            gate.open(),
            2,
            "a closed connection's place is the newcomer's"
        );
        // Both busy: a newcomer is refused and nobody is closed.
        let _also = third.busy();
        assert!(gate.admit().is_none());
        assert!(third.closed().now_or_never().is_none());
        // Done answering: the first is the oldest idle one again.
        drop(answering);
        let _fourth = gate.admit().unwrap();
        assert!(first.closed().now_or_never().is_some());
        drop(first);
        assert_eq!(gate.open(), 2);
    }
}
