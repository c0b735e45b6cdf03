//! Driver `static`: hosts whose agents already run, started by an operator with
//! `--backing-id <host name>` and a secret file. Nothing is ever created or deleted: a
//! pool's seat `n` is the `n`-th host of that pool (in config order), `launch` only
//! reports the host and `delete` leaves it alone.

use super::{FixedIdentity, LaunchSpec, Launched, ListedInstance, Provider, ProviderError};
use crate::config::StaticHost;
use slotpool_protocol::model::Instance;
use slotpool_protocol::BackingId;

/// A provider over a fixed list of hosts.
#[derive(Debug)]
pub struct StaticProvider {
    name: String,
    hosts: Vec<Host>,
}

#[derive(Debug)]
struct Host {
    config: StaticHost,
    backing_id: BackingId,
    secret: String,
}

impl StaticProvider {
    /// Reads every host's secret file now, so a missing or empty one is a config-time
    /// error naming the file.
    pub fn new(name: &str, hosts: &[StaticHost]) -> Result<StaticProvider, ProviderError> {
        let failed = |message: String| ProviderError::Failed {
            provider: name.to_string(),
            message,
        };
        let mut out = Vec::with_capacity(hosts.len());
        for host in hosts {
            let backing_id = BackingId::parse(&host.name)
                .map_err(|err| failed(format!("host {:?}: {err}", host.name)))?;
            let path = &host.secret_file;
            let secret = std::fs::read_to_string(path).map_err(|err| {
                failed(format!(
                    "host {:?}: reading secret file {}: {err}",
                    host.name,
                    path.display()
                ))
            })?;
            let secret = secret.trim().to_string();
            if secret.is_empty() {
                return Err(failed(format!(
                    "host {:?}: secret file {} is empty",
                    host.name,
                    path.display()
                )));
            }
            out.push(Host {
                config: host.clone(),
                backing_id,
                secret,
            });
        }
        Ok(StaticProvider {
            name: name.to_string(),
            hosts: out,
        })
    }

    fn instance(host: &Host) -> Instance {
        Instance {
            id: host.config.name.clone(),
            host: host.config.host.clone(),
            data: serde_json::Value::Null,
        }
    }
}

#[async_trait::async_trait]
impl Provider for StaticProvider {
    fn name(&self) -> &str {
        &self.name
    }

    fn creates_machines(&self) -> bool {
        false
    }

    fn fixed_identity(&self, pool: &str, seat: u32) -> Option<FixedIdentity> {
        let host = self
            .hosts
            .iter()
            .filter(|h| h.config.pool == pool)
            .nth(seat as usize)?;
        Some(FixedIdentity {
            backing_id: host.backing_id.clone(),
            secret: host.secret.clone(),
        })
    }

    /// Creates nothing: reports the host the backing id names.
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, ProviderError> {
        let host = self
            .hosts
            .iter()
            .find(|h| h.backing_id == spec.backing_id)
            .ok_or_else(|| ProviderError::Failed {
                provider: self.name.clone(),
                message: format!("no static host named {:?}", spec.backing_id.as_str()),
            })?;
        Ok(Launched {
            instance: Self::instance(host),
            attributes: host.config.attributes.clone(),
        })
    }

    /// Never deletes a static host.
    async fn delete(&self, _instance: &Instance) -> Result<(), ProviderError> {
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ListedInstance>, ProviderError> {
        Ok(self
            .hosts
            .iter()
            .map(|h| ListedInstance {
                instance: Self::instance(h),
                backing_id: Some(h.backing_id.clone()),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    fn host(dir: &Path, name: &str, pool: &str, secret: Option<&str>) -> StaticHost {
        let secret_file = dir.join(format!("{name}.secret"));
        if let Some(secret) = secret {
            std::fs::write(&secret_file, secret).unwrap();
        }
        StaticHost {
            name: name.to_string(),
            host: format!("{name}.example.org"),
            pool: pool.to_string(),
            secret_file,
            attributes: [("zone".to_string(), serde_json::json!(name))].into(),
        }
    }

    fn spec(backing_id: &str) -> LaunchSpec {
        LaunchSpec {
            backing_id: BackingId::parse(backing_id).unwrap(),
            secret: "ignored".into(),
            provider: "hosts".into(),
            pool: "a".into(),
            backing_label: "big".into(),
            slots: 4,
            nats_url: "nats://127.0.0.1:4222".into(),
            credentials: None,
            timeout: Duration::from_secs(5),
            create_queue: None,
        }
    }

    #[tokio::test]
    async fn seats_map_to_the_hosts_of_their_pool_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = [
            host(dir.path(), "h1", "a", Some("s1\n")),
            host(dir.path(), "h2", "b", Some("s2")),
            host(dir.path(), "h3", "a", Some("  s3  \n")),
        ];
        let p = StaticProvider::new("hosts", &hosts).unwrap();
        let id = |pool, seat| {
            p.fixed_identity(pool, seat)
                .map(|f| (f.backing_id.to_string(), f.secret))
        };
        assert_eq!(id("a", 0), Some(("h1".into(), "s1".into())));
        assert_eq!(id("a", 1), Some(("h3".into(), "s3".into())));
        assert_eq!(id("a", 2), None);
        assert_eq!(id("b", 0), Some(("h2".into(), "s2".into())));
        assert_eq!(id("c", 0), None);

        let launched = p.launch(&spec("h3")).await.unwrap();
        assert_eq!(launched.instance.id, "h3");
        assert_eq!(launched.instance.host, "h3.example.org");
        assert!(launched.instance.data.is_null());
        assert_eq!(launched.attributes["zone"], serde_json::json!("h3"));
        assert!(p.launch(&spec("h9")).await.is_err());

        p.delete(&launched.instance).await.unwrap();
        let listed = p.list().await.unwrap();
        let ids: Vec<_> = listed.iter().map(|l| l.instance.id.as_str()).collect();
        assert_eq!(ids, ["h1", "h2", "h3"]);
        assert_eq!(listed[1].backing_id.as_ref().unwrap().as_str(), "h2");
    }

    #[test]
    fn a_missing_or_empty_secret_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = host(dir.path(), "h1", "a", None);
        let err = StaticProvider::new("hosts", std::slice::from_ref(&missing))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("hosts: host \"h1\": reading secret file "),
            "{err}"
        );
        assert!(
            err.contains(&missing.secret_file.display().to_string()),
            "{err}"
        );

        let empty = host(dir.path(), "h2", "a", Some("\n"));
        let err = StaticProvider::new("hosts", &[empty])
            .unwrap_err()
            .to_string();
        assert!(err.contains("h2.secret is empty"), "{err}");
    }
}
