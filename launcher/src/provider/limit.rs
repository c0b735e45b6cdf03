//! Limits on a provider's `launch` calls, per launcher process: `max-creates-per-second`
//! (a [`TokenBucket`]) and `max-concurrent-creates` (a semaphore). [`Limited`] wraps a
//! provider with them; a launch waits for both before it starts, and only then does its
//! `launch-timeout` ([`LaunchSpec::timeout`]) run, so time spent queued behind other
//! launches never counts against it. Several launchers each apply the limits on their
//! own: a provider's own quota is shared by all of them.

use super::{FixedIdentity, LaunchSpec, Launched, ListedInstance, Provider, ProviderError};
use crate::config::CreateLimits;
use crate::metrics::{self, ProviderCall};
use slotpool_protocol::model::Instance;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// A token bucket that hands out reservations: [`TokenBucket::reserve`] always takes a
/// token and says how long to wait before using it, so concurrent callers queue in the
/// order they asked without retrying. Pure: the clock comes in as an argument.
#[derive(Debug)]
pub struct TokenBucket {
    /// Tokens added per second.
    rate: f64,
    /// The most tokens the bucket holds (a second's worth, at least one).
    burst: f64,
    /// May go negative: tokens already promised to callers still waiting.
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(rate: f64, now: Instant) -> TokenBucket {
        let burst = rate.max(1.0);
        TokenBucket {
            rate,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes a token at `now`; returns how long to wait before it may be used.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst) - 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

/// A provider whose launches are limited (and timed out at `launch-timeout`).
pub struct Limited {
    inner: Arc<dyn Provider>,
    bucket: Option<Mutex<TokenBucket>>,
    concurrent: Option<Semaphore>,
}

impl Limited {
    pub fn new(inner: Arc<dyn Provider>, limits: CreateLimits) -> Limited {
        Limited {
            inner,
            bucket: limits
                .per_second
                .map(|rate| Mutex::new(TokenBucket::new(rate, Instant::now()))),
            concurrent: limits.concurrent.map(|n| Semaphore::new(n as usize)),
        }
    }
}

impl Limited {
    /// Counts a failed call in `/metrics`.
    fn counted<T>(
        &self,
        call: ProviderCall,
        result: Result<T, ProviderError>,
    ) -> Result<T, ProviderError> {
        if let Err(err) = &result {
            metrics::provider_error(self.inner.name(), call, err.kind());
        }
        result
    }
}

#[async_trait::async_trait]
impl Provider for Limited {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn fixed_identity(&self, pool: &str, seat: u32) -> Option<FixedIdentity> {
        self.inner.fixed_identity(pool, seat)
    }

    fn creates_machines(&self) -> bool {
        self.inner.creates_machines()
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError> {
        let mut queued = false;
        let mut queue = || {
            if !std::mem::replace(&mut queued, true) {
                if let Some(q) = &spec.create_queue {
                    q.queued.notify_one();
                }
            }
        };
        let _permit = match &self.concurrent {
            Some(s) => Some(match s.try_acquire() {
                Ok(permit) => permit,
                Err(_) => {
                    queue();
                    s.acquire().await.expect("the semaphore is never closed")
                }
            }),
            None => None,
        };
        if let Some(bucket) = &self.bucket {
            let wait = bucket
                .lock()
                .expect("token bucket lock")
                .reserve(Instant::now());
            if !wait.is_zero() {
                tracing::debug!(?wait, "max-creates-per-second: launch waits");
                queue();
                tokio::time::sleep(wait).await;
            }
        }
        if queued {
            if let Some(q) = &spec.create_queue {
                q.admitted.notify_one();
            }
        }
        let result = match tokio::time::timeout(spec.timeout, self.inner.launch(spec)).await {
            Ok(result) => result,
            Err(_) => Err(ProviderError::Timeout {
                provider: self.inner.name().to_string(),
                timeout: spec.timeout,
            }),
        };
        self.counted(ProviderCall::Launch, result)
    }

    async fn delete(&self, instance: &Instance) -> Result<(), ProviderError> {
        let result = self.inner.delete(instance).await;
        self.counted(ProviderCall::Delete, result)
    }

    async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
        let result = self.inner.list().await;
        self.counted(ProviderCall::List, result)
    }

    async fn console(&self, instance: &Instance) -> Result<Option<String>, ProviderError> {
        self.inner.console(instance).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::BackingId;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn the_bucket_spaces_launches_at_its_rate_after_a_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2.0, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert_eq!(b.reserve(t0), Duration::ZERO, "a second's worth at once");
        assert_eq!(b.reserve(t0), Duration::from_millis(500));
        assert_eq!(b.reserve(t0), Duration::from_millis(1000), "queued behind");
        // A second later two tokens came back, both already promised.
        assert_eq!(
            b.reserve(t0 + Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        // Long idle refills the bucket, never beyond its burst.
        let later = t0 + Duration::from_secs(60);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert_eq!(b.reserve(later), Duration::from_millis(500));
    }

    #[test]
    fn a_slow_rate_has_a_burst_of_one() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(0.5, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert_eq!(b.reserve(t0), Duration::from_secs(2));
        let mut b = TokenBucket::new(0.5, t0);
        assert_eq!(b.reserve(t0 + Duration::from_secs(100)), Duration::ZERO);
        assert_eq!(
            b.reserve(t0 + Duration::from_secs(100)),
            Duration::from_secs(2)
        );
    }

    /// Counts launches running at once, and the most ever.
    #[derive(Default)]
    struct Overlap {
        now: AtomicU32,
        most: AtomicU32,
        done: AtomicU32,
    }

    #[async_trait::async_trait]
    impl Provider for Overlap {
        fn name(&self) -> &str {
            "fake"
        }
        async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError> {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(n, Ordering::SeqCst);
            // Give the others every chance to start meanwhile.
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            self.done.fetch_add(1, Ordering::SeqCst);
            Ok(Launched {
                instance: Instance {
                    id: spec.backing_id.to_string(),
                    host: "h".into(),
                    data: serde_json::Value::Null,
                },
                attributes: Default::default(),
            })
        }
        async fn delete(&self, _: &Instance) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
            Ok(Vec::new())
        }
    }

    fn spec(n: u32) -> LaunchSpec {
        LaunchSpec {
            backing_id: BackingId::parse(&format!("bn-{n}")).unwrap(),
            secret: "s".into(),
            provider: "fake".into(),
            pool: "main".into(),
            backing_label: "vm".into(),
            slots: 1,
            nats_url: "nats://127.0.0.1:4222".into(),
            credentials: None,
            timeout: Duration::from_secs(30),
            create_queue: None,
        }
    }

    async fn most_at_once(limits: CreateLimits) -> u32 {
        let inner = Arc::new(Overlap::default());
        let limited = Arc::new(Limited::new(inner.clone(), limits));
        let launches = (0..8).map(|n| {
            let l = limited.clone();
            tokio::spawn(async move { l.launch(&spec(n)).await.unwrap() })
        });
        for launch in futures::future::join_all(launches).await {
            launch.unwrap();
        }
        assert_eq!(inner.done.load(Ordering::SeqCst), 8);
        inner.most.load(Ordering::SeqCst)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn max_concurrent_creates_one_never_overlaps() {
        let one = CreateLimits {
            per_second: None,
            concurrent: Some(1),
        };
        assert_eq!(most_at_once(one).await, 1);
        let three = CreateLimits {
            per_second: None,
            concurrent: Some(3),
        };
        assert!(most_at_once(three).await <= 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_launch_times_out_only_after_it_was_admitted() {
        struct Hangs;
        #[async_trait::async_trait]
        impl Provider for Hangs {
            fn name(&self) -> &str {
                "hangs"
            }
            async fn launch(&self, _: &LaunchSpec) -> Result<Launched, ProviderError> {
                std::future::pending().await
            }
            async fn delete(&self, _: &Instance) -> Result<(), ProviderError> {
                Ok(())
            }
            async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
                Ok(Vec::new())
            }
        }
        let limited = Limited::new(
            Arc::new(Hangs),
            CreateLimits {
                per_second: Some(0.1),
                concurrent: None,
            },
        );
        let mut s = spec(1);
        s.timeout = Duration::from_secs(5);
        let t0 = Instant::now();
        let err = limited.launch(&s).await.unwrap_err();
        assert!(matches!(err, ProviderError::Timeout { .. }), "{err}");
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(5),
            "the first is admitted at once"
        );
        let err = limited.launch(&s).await.unwrap_err();
        assert!(matches!(err, ProviderError::Timeout { .. }), "{err}");
        // Admitted 10 s after the first (0.1 per second), then 5 s of launch-timeout.
        assert_eq!(t0.elapsed(), Duration::from_secs(15));
    }
}
