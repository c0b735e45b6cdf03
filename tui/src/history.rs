//! What the pools did over the last minutes: slots used and requests waiting per pool,
//! sampled from the pool rows on a tick every [`SAMPLE_MS`] and kept for [`SAMPLES`]
//! samples, for the detail pane's sparklines.
//!
//! Pure: the time is the tick's.

use crate::rows::PoolRow;
use slotpool_protocol::time::UnixMillis;
use std::collections::{BTreeMap, VecDeque};

/// How often a sample is taken.
pub const SAMPLE_MS: UnixMillis = 5_000;
/// How many samples are kept per pool (with [`SAMPLE_MS`]: the last ten minutes).
pub const SAMPLES: usize = 120;

/// One pool's samples, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub used: VecDeque<u64>,
    pub waiting: VecDeque<u64>,
}

/// Every pool's samples, by pool row key.
#[derive(Clone, Debug, Default)]
pub struct History {
    last: Option<UnixMillis>,
    pools: BTreeMap<String, Series>,
}

impl History {
    /// Takes a sample of `pools` if the last one is [`SAMPLE_MS`] old; a pool that has
    /// no row any more is forgotten.
    pub fn sample(&mut self, now: UnixMillis, pools: &[PoolRow]) {
        if self.last.is_some_and(|t| now < t + SAMPLE_MS) {
            return;
        }
        self.last = Some(now);
        self.pools
            .retain(|key, _| pools.iter().any(|p| p.key() == *key));
        for p in pools {
            let s = self.pools.entry(p.key()).or_default();
            s.used.push_back(u64::from(p.used));
            s.waiting.push_back(p.waiting as u64);
            while s.used.len() > SAMPLES {
                s.used.pop_front();
                s.waiting.pop_front();
            }
        }
    }

    /// The samples of the pool row `key`.
    pub fn series(&self, key: &str) -> Option<&Series> {
        self.pools.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(used: u32, waiting: usize) -> PoolRow {
        PoolRow {
            provider: "cloud".into(),
            pool: "main".into(),
            label: "small".into(),
            used,
            waiting,
            ..Default::default()
        }
    }

    #[test]
    fn samples_every_interval_and_keeps_the_last_ones() {
        let mut h = History::default();
        h.sample(0, &[pool(1, 0)]);
        h.sample(SAMPLE_MS - 1, &[pool(9, 9)]);
        h.sample(SAMPLE_MS, &[pool(2, 3)]);
        let s = h.series("cloud/main/small").unwrap();
        assert_eq!(s.used, [1, 2]);
        assert_eq!(s.waiting, [0, 3]);
        for i in 0..SAMPLES as u64 + 5 {
            h.sample(SAMPLE_MS * (2 + i), &[pool(i as u32, 0)]);
        }
        let s = h.series("cloud/main/small").unwrap();
        assert_eq!(s.used.len(), SAMPLES);
        assert_eq!(s.used.back(), Some(&(SAMPLES as u64 + 4)));
        // A pool gone from the rows is forgotten.
        h.sample(SAMPLE_MS * 1000, &[]);
        assert!(h.series("cloud/main/small").is_none());
    }
}
