//! Where the time of one slot operation goes: [`StepClock`] notes how long each step of
//! a release or a warm-up took, and the CPU its thread spent on it, and logs them in one
//! debug event when the operation ends (`RUST_LOG=info,slotpool_agent=debug`). Off, it
//! costs a clock read per step.

use std::time::{Duration, Instant};

/// The steps of one operation, each with its duration and its thread's CPU time in
/// microseconds.
pub struct StepClock {
    started: Instant,
    last: Instant,
    /// The thread's CPU time at the last step; `None` when debug logging is off.
    last_cpu: Option<Duration>,
    laps: Vec<(&'static str, u64, u64)>,
}

/// The calling thread's CPU time (user and system; not its children's).
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

impl StepClock {
    /// Starts timing an operation now.
    pub fn start() -> StepClock {
        let now = Instant::now();
        StepClock {
            started: now,
            last: now,
            last_cpu: tracing::enabled!(tracing::Level::DEBUG).then(thread_cpu),
            laps: Vec::with_capacity(16),
        }
    }

    /// The step `step` ended now (it began where the previous one ended).
    pub fn lap(&mut self, step: &'static str) {
        let now = Instant::now();
        let cpu_us = match self.last_cpu {
            Some(last) => {
                let cpu = thread_cpu();
                self.last_cpu = Some(cpu);
                cpu.saturating_sub(last).as_micros() as u64
            }
            None => 0,
        };
        self.laps.push((
            step,
            now.duration_since(self.last).as_micros() as u64,
            cpu_us,
        ));
        self.last = now;
    }

    /// The steps as `name=µs` pairs, in order.
    pub fn steps(&self) -> String {
        self.list(|&(_, us, _)| us)
    }

    /// The thread's CPU time in each step, as `name=µs` pairs, in order (zeros with
    /// debug logging off).
    pub fn cpu(&self) -> String {
        self.list(|&(_, _, cpu_us)| cpu_us)
    }

    fn list(&self, value: impl Fn(&(&'static str, u64, u64)) -> u64) -> String {
        let mut text = String::new();
        for (i, lap) in self.laps.iter().enumerate() {
            if i > 0 {
                text.push(' ');
            }
            text.push_str(lap.0);
            text.push('=');
            text.push_str(&value(lap).to_string());
        }
        text
    }

    /// Logs the operation `op` of `slot` with its steps, at debug level.
    pub fn log(&self, slot: u32, op: &'static str) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let total_us = self.started.elapsed().as_micros() as u64;
            tracing::debug!(slot, timed = op, total_us, steps = %self.steps(), cpu = %self.cpu(), "slot steps timed");
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

    #[test]
    fn with_debug_logging_each_step_has_its_threads_cpu_time() {
        let debug = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(debug, || {
            let mut clock = StepClock::start();
            std::thread::sleep(Duration::from_millis(30));
            clock.lap("sleep");
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_millis(30) {
                std::hint::black_box(0);
            }
            clock.lap("spin");
            let cpu: Vec<u64> = clock
                .cpu()
                .split(' ')
                .map(|s| s.split('=').nth(1).unwrap().parse().unwrap())
                .collect();
            assert!(cpu[0] < 10_000, "sleeping took CPU: {}", clock.cpu());
            assert!(cpu[1] >= 20_000, "spinning took no CPU: {}", clock.cpu());
        });
        let mut off = StepClock::start();
        off.lap("a");
        assert_eq!(
            off.cpu(),
            "a=0",
            "without debug logging no CPU clock is read"
        );
    }
}
