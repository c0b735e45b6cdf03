//! Where the time of one slot operation goes: [`StepClock`] notes how long each step of
//! a release or a warm-up took and logs them in one debug event when the operation ends
//! (`RUST_LOG=info,slotpool_agent=debug`). Off, it costs a clock read per step.

use std::time::Instant;

/// The steps of one operation, each with its duration in microseconds.
pub struct StepClock {
    started: Instant,
    last: Instant,
    laps: Vec<(&'static str, u64)>,
}

impl StepClock {
    /// Starts timing an operation now.
    pub fn start() -> StepClock {
        let now = Instant::now();
        StepClock {
            started: now,
            last: now,
            laps: Vec::with_capacity(16),
        }
    }

    /// The step `step` ended now (it began where the previous one ended).
    pub fn lap(&mut self, step: &'static str) {
        let now = Instant::now();
        self.laps
            .push((step, now.duration_since(self.last).as_micros() as u64));
        self.last = now;
    }

    /// The steps as `name=µs` pairs, in order.
    pub fn steps(&self) -> String {
        let mut text = String::new();
        for (i, (step, us)) in self.laps.iter().enumerate() {
            if i > 0 {
                text.push(' ');
            }
            text.push_str(step);
            text.push('=');
            text.push_str(&us.to_string());
        }
        text
    }

    /// Logs the operation `op` of `slot` with its steps, at debug level.
    pub fn log(&self, slot: u32, op: &'static str) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let total_us = self.started.elapsed().as_micros() as u64;
            tracing::debug!(slot, timed = op, total_us, steps = %self.steps(), "slot steps timed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_listed_in_order_with_their_names() {
        let mut clock = StepClock::start();
        clock.lap("kill");
        clock.lap("wipe");
        let steps = clock.steps();
        let names: Vec<&str> = steps
            .split(' ')
            .map(|s| s.split('=').next().unwrap())
            .collect();
        assert_eq!(names, ["kill", "wipe"]);
        assert!(steps.split(' ').all(|s| s
            .split('=')
            .nth(1)
            .is_some_and(|us| us.parse::<u64>().is_ok())));
    }
}
