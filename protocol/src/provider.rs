//! The messages of the exec provider contract: what slotpool sends a provider's `create`,
//! `delete`, `list` and (optional) `console` commands on stdin and what they print on
//! stdout. The contract itself (versions, exit codes, time limits, the JSON schema of
//! each message) is written once, in `docs/providers.md`; a test checks these types
//! against it.
//!
//! The launcher's `exec` driver sends these; first-party providers (`slotpool-provider-ec2`)
//! and `slotpool provider check` read them with the same types.

use crate::model::Attributes;
use serde::{Deserialize, Serialize};

/// The newest version of the contract, the one slotpool speaks. Each message it sends
/// carries as `"v"` the version that last changed that message (`VERSION` of its type),
/// so that a provider written for an older version reads what it knows unchanged.
pub const CONTRACT_VERSION: u32 = 3;

/// The exit code that means "out of quota or capacity, ask again later" (`EX_TEMPFAIL`).
pub const EXIT_CAPACITY: i32 = 75;

/// What `create` reads on stdin: start one machine whose agent runs with these.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct CreateRequest {
    /// The contract version, 2.
    pub v: u32,
    /// The agent's `--backing-id`; also what `list` reports the machine under.
    pub backing_id: String,
    /// The agent's secret (`SLOTPOOL_AGENT_SECRET` or `--secret-file`). A new one for
    /// every launch attempt of a backing node; never on a command line or in a log.
    pub secret: String,
    /// The provider's name in the launcher's configuration.
    pub provider: String,
    /// The pool the machine is for.
    pub pool: String,
    /// The kind of machine (`backing-label` of the size the planner chose).
    pub backing_label: String,
    /// The agent's `--slots`.
    pub slots: u32,
    /// The agent's `--nats`.
    pub nats_url: String,
    /// The agent's own bus credential (the text of a `.creds` file), minted for this
    /// backing node alone; absent on a development bus without authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats_credentials: Option<String>,
}

impl CreateRequest {
    /// The `"v"` of a create request: the version that last changed it.
    pub const VERSION: u32 = 2;
}

impl std::fmt::Debug for CreateRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateRequest")
            .field("v", &self.v)
            .field("backing_id", &self.backing_id)
            .field("secret", &"<redacted>")
            .field("provider", &self.provider)
            .field("pool", &self.pool)
            .field("backing_label", &self.backing_label)
            .field("slots", &self.slots)
            .field("nats_url", &self.nats_url)
            .field(
                "nats_credentials",
                &self.nats_credentials.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// What `create` prints on stdout once the machine exists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct Created {
    /// The provider's id of the machine; non-empty.
    pub id: String,
    /// Where slots are reached (address or host name); non-empty.
    pub host: String,
    /// Anything the provider wants back in `delete`.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
    /// Copied onto the nodes of this machine.
    #[serde(default, skip_serializing_if = "Attributes::is_empty")]
    pub attributes: Attributes,
}

/// What `delete` reads on stdin: what `create` printed (`id`, `host`, `data`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct DeleteRequest {
    /// The contract version, 2.
    pub v: u32,
    pub id: String,
    pub host: String,
    #[serde(default)]
    pub data: serde_json::Value,
}

impl DeleteRequest {
    /// The `"v"` of a delete request: the version that last changed it.
    pub const VERSION: u32 = 2;
}

/// What the optional `console` command reads on stdin: a machine whose agent did not come
/// up, as `create` printed it (`id`, `host`, `data`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct ConsoleRequest {
    /// The contract version, 3.
    pub v: u32,
    pub id: String,
    pub host: String,
    #[serde(default)]
    pub data: serde_json::Value,
}

impl ConsoleRequest {
    /// The `"v"` of a console request: the version that added it.
    pub const VERSION: u32 = 3;
}

/// What `console` prints on stdout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct ConsoleOutput {
    /// The machine's console output as text, oldest first; empty when the machine has
    /// none (yet) or is gone. The launcher keeps its end.
    pub output: String,
}

/// One element of the JSON array `list` prints: a machine the provider created.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct ListedMachine {
    pub id: String,
    pub host: String,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
    /// The backing id the machine was created for (from a tag, say). Optional, but
    /// without it the leak sweep cannot tell whose a machine is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing_id: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = include_str!("../../docs/providers.md");

    /// The text of the fenced block after the marker `<!-- {kind}: {name} -->` in the doc.
    fn block(kind: &str, name: &str) -> String {
        let marker = format!("<!-- {kind}: {name} -->");
        let at = DOC
            .find(&marker)
            .unwrap_or_else(|| panic!("docs/providers.md has no {marker}"));
        let rest = &DOC[at + marker.len()..];
        let start = rest
            .find("```json\n")
            .expect("a json block after the marker")
            + 8;
        let end = rest[start..].find("```").expect("the block's end");
        rest[start..start + end].to_string()
    }

    fn schemas() -> Vec<(&'static str, schemars::Schema)> {
        vec![
            ("create-request", schemars::schema_for!(CreateRequest)),
            ("created", schemars::schema_for!(Created)),
            ("delete-request", schemars::schema_for!(DeleteRequest)),
            ("list", schemars::schema_for!(Vec<ListedMachine>)),
            ("console-request", schemars::schema_for!(ConsoleRequest)),
            ("console", schemars::schema_for!(ConsoleOutput)),
        ]
    }

    /// With `SLOTPOOL_BLESS_DOCS=1`, writes the generated schemas into the doc instead of
    /// comparing (after a change of the types; review the diff).
    #[test]
    fn the_documented_schemas_are_generated_from_these_types() {
        if std::env::var_os("SLOTPOOL_BLESS_DOCS").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/providers.md");
            let mut doc = std::fs::read_to_string(path).unwrap();
            for (name, schema) in schemas() {
                let marker = format!("<!-- schema: {name} -->");
                let at = doc.find(&marker).unwrap() + marker.len();
                let start = at + doc[at..].find("```json\n").unwrap() + 8;
                let end = start + doc[start..].find("```").unwrap();
                let want = serde_json::to_string_pretty(&schema).unwrap() + "\n";
                doc.replace_range(start..end, &want);
            }
            std::fs::write(path, doc).unwrap();
            return;
        }
        for (name, schema) in schemas() {
            let want = serde_json::to_string_pretty(&schema).unwrap() + "\n";
            assert_eq!(
                block("schema", name),
                want,
                "docs/providers.md's schema {name} is not the code's; it should read:\n{want}"
            );
        }
    }

    #[test]
    fn the_documented_examples_are_read_by_these_types() {
        let create: CreateRequest =
            serde_json::from_str(&block("example", "create-request")).unwrap();
        assert_eq!(create.v, CreateRequest::VERSION);
        let created: Created = serde_json::from_str(&block("example", "created")).unwrap();
        assert!(!created.id.is_empty() && !created.host.is_empty());
        let delete: DeleteRequest =
            serde_json::from_str(&block("example", "delete-request")).unwrap();
        assert_eq!(delete.v, DeleteRequest::VERSION);
        assert_eq!(
            (delete.id.as_str(), &delete.data),
            (created.id.as_str(), &created.data)
        );
        let list: Vec<ListedMachine> = serde_json::from_str(&block("example", "list")).unwrap();
        assert_eq!(
            list[0].backing_id.as_deref(),
            Some(create.backing_id.as_str())
        );
        let console: ConsoleRequest =
            serde_json::from_str(&block("example", "console-request")).unwrap();
        assert_eq!(console.v, ConsoleRequest::VERSION);
        assert_eq!(
            (console.id.as_str(), &console.data),
            (created.id.as_str(), &created.data)
        );
        let output: ConsoleOutput = serde_json::from_str(&block("example", "console")).unwrap();
        assert!(!output.output.is_empty());
    }

    #[test]
    fn the_doc_states_the_version_and_the_capacity_exit_the_code_uses() {
        assert!(DOC.contains(&format!("# The exec contract, version {CONTRACT_VERSION}")));
        for (message, v) in [
            ("create", CreateRequest::VERSION),
            ("delete", DeleteRequest::VERSION),
            ("console", ConsoleRequest::VERSION),
        ] {
            assert!(
                DOC.contains(&format!("| {message} | {v} |")),
                "docs/providers.md does not say {message} carries version {v}"
            );
        }
        assert!(DOC.contains(&format!("Exit code {EXIT_CAPACITY}")));
    }

    #[test]
    fn the_debug_form_of_a_create_request_hides_the_secrets() {
        let req = CreateRequest {
            v: CreateRequest::VERSION,
            backing_id: "bn-1".into(),
            secret: "top-secret".into(),
            provider: "cloud".into(),
            pool: "main".into(),
            backing_label: "vm".into(),
            slots: 2,
            nats_url: "nats://10.0.0.1:4222".into(),
            nats_credentials: Some("-----BEGIN NATS USER JWT-----".into()),
        };
        let shown = format!("{req:?}");
        assert!(!shown.contains("top-secret"), "{shown}");
        assert!(!shown.contains("BEGIN NATS"), "{shown}");
        assert!(shown.contains("bn-1"), "{shown}");
    }

    #[test]
    fn unknown_fields_are_ignored_and_optional_ones_default() {
        let c: Created =
            serde_json::from_str(r#"{"id": "i-1", "host": "10.0.0.7", "later": 1}"#).unwrap();
        assert!(c.data.is_null() && c.attributes.is_empty());
        let l: Vec<ListedMachine> =
            serde_json::from_str(r#"[{"id": "i-1", "host": "h", "extra": true}]"#).unwrap();
        assert_eq!(l[0].backing_id, None);
    }
}
