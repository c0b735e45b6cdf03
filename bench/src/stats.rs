//! Latency samples and their percentiles.
//!
//! A sorted `Vec` rather than a histogram: a run records at most some hundred thousand
//! samples, so keeping them all costs a few MB at most, and the percentiles are exact
//! (nearest rank) instead of bucketed, with no extra dependency.

use serde::Serialize;
use std::time::Duration;

/// Durations recorded in milliseconds.
#[derive(Clone, Debug, Default)]
pub struct Samples(Vec<f64>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64() * 1000.0);
    }

    pub fn push_ms(&mut self, ms: f64) {
        self.0.push(ms);
    }

    pub fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn summary(&self) -> Summary {
        let mut v = self.0.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |p: f64| -> f64 {
            if v.is_empty() {
                return 0.0;
            }
            let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
            v[rank - 1]
        };
        Summary {
            count: v.len(),
            min_ms: v.first().copied().unwrap_or(0.0),
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p99_ms: at(0.99),
            max_ms: v.last().copied().unwrap_or(0.0),
            mean_ms: if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            },
        }
    }
}

/// Percentiles of a set of samples, in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Summary {
    pub count: usize,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut s = Samples::default();
        for ms in 1..=100 {
            s.push_ms(ms as f64);
        }
        let sum = s.summary();
        assert_eq!(
            (sum.count, sum.p50_ms, sum.p90_ms, sum.p99_ms, sum.max_ms),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(Samples::default().summary().p99_ms, 0.0);
    }
}
