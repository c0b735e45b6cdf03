//! Traces: the jobs of a day, read from CSV or JSON lines, or generated (a diurnal
//! Poisson day with lognormal job durations).

use super::rng::Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One job: when it asks for nodes, the labels of the nodes (one node each), and how
/// long it holds them once it has them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Job {
    /// Milliseconds from the start of the trace.
    pub arrival_ms: u64,
    pub labels: Vec<String>,
    pub duration_ms: u64,
    /// The tenant (team) whose job it is, by name (`None`: the default tenant).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// What a trace line may be, said in every parse error.
pub const ACCEPTED: &str =
    "accepted: CSV `arrival_secs,labels,duration_secs[,tenant]` (labels joined by `+`, \
an optional header line, `#` comments) or one JSON object a line \
{\"arrival\": secs, \"labels\": [\"small\"], \"duration\": secs, \"tenant\": \"web\"} \
(or \"label\": \"small\"; tenant optional)";

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {problem}; {ACCEPTED}")]
    Line {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("{path}: no jobs; {ACCEPTED}")]
    Empty { path: PathBuf },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonJob {
    arrival: f64,
    #[serde(default)]
    labels: Vec<String>,
    label: Option<String>,
    duration: f64,
    tenant: Option<String>,
}

/// Reads the trace at `path`.
pub fn load(path: &Path) -> Result<Vec<Job>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text)
}

/// Parses a trace (`path` only names it in errors); jobs come out in arrival order.
pub fn parse(path: &Path, text: &str) -> Result<Vec<Job>, TraceError> {
    let mut jobs = Vec::new();
    let mut first = true;
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let header = first && line.starts_with("arrival");
        first = false;
        if header {
            continue;
        }
        let job = parse_line(line).map_err(|problem| TraceError::Line {
            path: path.to_path_buf(),
            line: index + 1,
            problem,
        })?;
        jobs.push(job);
    }
    if jobs.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }
    jobs.sort_by_key(|j| j.arrival_ms);
    Ok(jobs)
}

fn parse_line(line: &str) -> Result<Job, String> {
    let (arrival, labels, duration, tenant) = if line.starts_with('{') {
        let j: JsonJob = serde_json::from_str(line).map_err(|e| format!("bad JSON line: {e}"))?;
        let labels = match (j.labels.is_empty(), j.label) {
            (true, Some(l)) => vec![l],
            (false, None) => j.labels,
            (true, None) => return Err("no \"labels\" or \"label\"".into()),
            (false, Some(_)) => return Err("both \"labels\" and \"label\"".into()),
        };
        (j.arrival, labels, j.duration, j.tenant)
    } else {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let (arrival, labels, duration, tenant) = match fields[..] {
            [arrival, labels, duration] => (arrival, labels, duration, None),
            [arrival, labels, duration, tenant] => {
                (arrival, labels, duration, Some(tenant.to_string()))
            }
            _ => return Err(format!("{} fields, not 3 or 4", fields.len())),
        };
        let number = |what: &str, s: &str| {
            s.parse::<f64>()
                .map_err(|_| format!("{what} {s:?} is not a number of seconds"))
        };
        let labels = labels.split('+').map(|l| l.trim().to_string()).collect();
        (
            number("arrival", arrival)?,
            labels,
            number("duration", duration)?,
            tenant,
        )
    };
    if tenant.as_deref().is_some_and(str::is_empty) {
        return Err("an empty tenant".into());
    }
    if labels.iter().any(|l: &String| l.is_empty()) {
        return Err("an empty label".into());
    }
    for (what, secs) in [("arrival", arrival), ("duration", duration)] {
        if !secs.is_finite() || secs < 0.0 {
            return Err(format!(
                "{what} {secs} is not a time of zero seconds or more"
            ));
        }
    }
    Ok(Job {
        arrival_ms: (arrival * 1000.0).round() as u64,
        labels,
        duration_ms: (duration * 1000.0).round() as u64,
        tenant,
    })
}

/// The synthetic day: Poisson arrivals whose rate follows the day (a tenth of `peak` at
/// midnight, `peak` at noon), each job one node of `label` held for a lognormal time.
#[derive(Clone, Debug, PartialEq)]
pub struct Diurnal {
    /// Jobs a minute at the peak.
    pub peak_per_min: f64,
    pub hours: f64,
    pub median_job_secs: f64,
    /// Shape of the job durations' lognormal.
    pub sigma: f64,
    pub label: String,
    pub seed: u64,
}

impl Diurnal {
    /// Arrival rate (jobs a second) at `t` seconds into the day.
    fn rate(&self, t: f64) -> f64 {
        let phase = (1.0 - (std::f64::consts::TAU * t / 86_400.0).cos()) / 2.0;
        self.peak_per_min / 60.0 * (0.1 + 0.9 * phase)
    }

    /// The jobs, by thinning a Poisson stream at the peak rate.
    pub fn generate(&self) -> Vec<Job> {
        let mut rng = Rng::new(self.seed);
        let peak = self.peak_per_min / 60.0;
        let horizon = self.hours * 3600.0;
        let mut jobs = Vec::new();
        if peak <= 0.0 {
            return jobs;
        }
        let mut t = 0.0;
        loop {
            t += rng.exponential(peak);
            if t >= horizon {
                return jobs;
            }
            let keep = rng.unit() < self.rate(t) / peak;
            let duration = rng.lognormal(self.median_job_secs, self.sigma);
            if keep {
                jobs.push(Job {
                    arrival_ms: (t * 1000.0).round() as u64,
                    labels: vec![self.label.clone()],
                    duration_ms: (duration * 1000.0).round() as u64,
                    tenant: None,
                });
            }
        }
    }
}

/// The jobs as CSV with a header, the form [`parse`] reads back.
pub fn to_csv(jobs: &[Job]) -> String {
    let tenants = jobs.iter().any(|j| j.tenant.is_some());
    let mut out = String::from(if tenants {
        "arrival_secs,labels,duration_secs,tenant\n"
    } else {
        "arrival_secs,labels,duration_secs\n"
    });
    for j in jobs {
        out.push_str(&format!(
            "{:.1},{},{:.1}",
            j.arrival_ms as f64 / 1000.0,
            j.labels.join("+"),
            j.duration_ms as f64 / 1000.0
        ));
        if tenants {
            out.push(',');
            out.push_str(
                j.tenant
                    .as_deref()
                    .unwrap_or(slotpool_config::tenants::DEFAULT_TENANT),
            );
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(text: &str) -> Result<Vec<Job>, TraceError> {
        parse(Path::new("day.csv"), text)
    }

    #[test]
    fn csv_and_json_lines_read_the_same_jobs() {
        let csv = parse_str(
            "arrival_secs,labels,duration_secs\n# a comment\n5,small+big,60\n0,small,1.5\n",
        )
        .unwrap();
        let json = parse_str(
            "{\"arrival\": 5, \"labels\": [\"small\", \"big\"], \"duration\": 60}\n{\"arrival\": 0, \"label\": \"small\", \"duration\": 1.5}\n",
        )
        .unwrap();
        assert_eq!(csv, json);
        assert_eq!(csv[0].labels, vec!["small"], "sorted by arrival");
        assert_eq!(csv[0].duration_ms, 1500);
        assert_eq!(csv[1].labels, vec!["small", "big"]);
    }

    #[test]
    fn a_tenant_column_is_read_in_csv_and_json_and_written_back() {
        let jobs = parse_str(
            "0,small,60,web\n5,small,60\n{\"arrival\": 9, \"label\": \"small\", \"duration\": 1, \"tenant\": \"ops\"}\n",
        )
        .unwrap();
        let tenants: Vec<Option<&str>> = jobs.iter().map(|j| j.tenant.as_deref()).collect();
        assert_eq!(tenants, [Some("web"), None, Some("ops")]);
        assert_eq!(
            parse_str(&to_csv(&jobs)).unwrap()[0].tenant.as_deref(),
            Some("web")
        );
        assert!(parse_str("0,small,60,\n").is_err(), "an empty tenant");
    }

    #[test]
    fn a_bad_line_is_named_with_what_is_accepted() {
        let err = parse_str("0,small,60\n\n3,small\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("day.csv:3: 2 fields, not 3 or 4; accepted: CSV"),
            "{err}"
        );
        let err = parse_str("0,small,soon\n").unwrap_err().to_string();
        assert!(
            err.starts_with("day.csv:1: duration \"soon\" is not a number"),
            "{err}"
        );
        let err = parse_str("{\"arrival\": -1, \"label\": \"s\", \"duration\": 1}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("day.csv:1: arrival -1 is not a time"),
            "{err}"
        );
        let err = parse_str("{\"arrival\": 1, \"duration\": 1}\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("day.csv:1: no \"labels\""), "{err}");
        let err = parse_str("# nothing\n").unwrap_err().to_string();
        assert!(err.starts_with("day.csv: no jobs"), "{err}");
    }

    #[test]
    fn the_generated_day_follows_its_seed_and_peaks_at_noon() {
        let day = Diurnal {
            peak_per_min: 6.0,
            hours: 24.0,
            median_job_secs: 600.0,
            sigma: 0.8,
            label: "small".into(),
            seed: 4,
        };
        let jobs = day.generate();
        assert_eq!(jobs, day.generate());
        let in_hour = |h: u64| {
            jobs.iter()
                .filter(|j| j.arrival_ms / 3_600_000 == h)
                .count()
        };
        assert!(
            in_hour(12) > 3 * in_hour(0),
            "noon {} midnight {}",
            in_hour(12),
            in_hour(0)
        );
        // About 0.55 × peak × 1440 jobs over the day.
        assert!((4000..5500).contains(&jobs.len()), "{}", jobs.len());
        assert_eq!(
            parse(Path::new("g"), &to_csv(&jobs)).unwrap().len(),
            jobs.len()
        );
    }
}
