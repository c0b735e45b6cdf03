//! Docs the tests keep true. Every JSON example in the docs is decoded with the real
//! type its `<!-- json: TYPE -->` note names (and must say nothing the type drops); every
//! field table a `<!-- fields: TYPE -->` note marks lists exactly the type's fields;
//! every option the docs name is one the programs accept (their own `--help`), and the
//! reference pages name every option; every pool-file key the docs name is one the
//! parser takes, and the reference and `examples/pool.yaml` name every key it takes;
//! every table is whole; the diagrams' pictures hold every label of their sources; a few
//! facts the code holds (limits, versions) are the docs' figures. The nats-py examples
//! run against a real installation in `docs_python.rs`.
//!
//! Each check prints what it counted (`cargo test --test docs -- --nocapture`).

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use slotpool_protocol::{api, model};
use slotpool_tests::bin_path;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the repository")
        .to_path_buf()
}

/// Every document a reader meets: the README, the architecture, docs/ and the
/// packaging notes.
fn documents() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![
        root.join("README.md"),
        root.join("ARCHITECTURE.md"),
        root.join("packaging/README.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn name(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A fenced code block.
struct Block {
    line: usize,
    lang: String,
    /// The `<!-- KIND: WHAT -->` note on the line before the fence, if any.
    note: Option<(String, String)>,
    text: String,
}

fn note_of(line: &str) -> Option<(String, String)> {
    let inner = line
        .trim()
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim();
    let (kind, what) = inner.split_once(':')?;
    Some((kind.trim().to_string(), what.trim().to_string()))
}

fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if let Some(lang) = lines[i].trim_start().strip_prefix("```") {
            let start = i;
            let note = (i > 0).then(|| note_of(lines[i - 1])).flatten();
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i]);
                i += 1;
            }
            out.push(Block {
                line: start + 1,
                lang: lang.trim().to_string(),
                note,
                text: body.join("\n"),
            });
        }
        i += 1;
    }
    out
}

/// Decodes `text` as `T` and encodes it again.
fn round_trip<T: DeserializeOwned + Serialize>(text: &str) -> Result<Value, String> {
    let value: T = serde_json::from_str(text).map_err(|e| e.to_string())?;
    serde_json::to_value(&value).map_err(|e| e.to_string())
}

/// Decodes `text` as the type named `ty` (as the docs' notes name them) and encodes it
/// again; `None` for a name this test does not know.
fn decode_as(ty: &str, text: &str) -> Option<Result<Value, String>> {
    use slotpool_protocol::provider;
    Some(match ty {
        "api::SubmitRequest" => round_trip::<api::SubmitRequest>(text),
        "api::Submitted" => round_trip::<api::Submitted>(text),
        "api::ReleaseNodes" => round_trip::<api::ReleaseNodes>(text),
        "api::Released" => round_trip::<api::Released>(text),
        "api::RequestStatus" => round_trip::<api::RequestStatus>(text),
        "api::NodesQuery" => round_trip::<api::NodesQuery>(text),
        "api::WaitReleased" => round_trip::<api::WaitReleased>(text),
        "api::StillHeld" => round_trip::<api::StillHeld>(text),
        "api::CancelRequest" => round_trip::<api::CancelRequest>(text),
        "api::Canceled" => round_trip::<api::Canceled>(text),
        "api::KeepAlive" => round_trip::<api::KeepAlive>(text),
        "api::KeptAlive" => round_trip::<api::KeptAlive>(text),
        "exec::ExecRequest" => round_trip::<slotpool_protocol::exec::ExecRequest>(text),
        "exec::ExecStarted" => round_trip::<slotpool_protocol::exec::ExecStarted>(text),
        "exec::ExecExit" => round_trip::<slotpool_protocol::exec::ExecExit>(text),
        "api::BackingOrder" => round_trip::<api::BackingOrder>(text),
        "api::OrderTaken" => round_trip::<api::OrderTaken>(text),
        "api::ReleaseNodeOrder" => round_trip::<api::ReleaseNodeOrder>(text),
        "api::AgentCommand" => round_trip::<api::AgentCommand>(text),
        "api::SlotPrepared" => round_trip::<api::SlotPrepared>(text),
        "api::SlotReleased" => round_trip::<api::SlotReleased>(text),
        "api::SlotsClosed" => round_trip::<api::SlotsClosed>(text),
        "api::SlotOccupants" => round_trip::<api::SlotOccupants>(text),
        "api::LogTail" => round_trip::<api::LogTail>(text),
        "api::ApiError" => round_trip::<api::ApiError>(text),
        "model::NodeRequest" => round_trip::<model::NodeRequest>(text),
        "model::Node" => round_trip::<model::Node>(text),
        "model::BackingNode" => round_trip::<model::BackingNode>(text),
        "model::AgentHeartbeat" => round_trip::<model::AgentHeartbeat>(text),
        "model::Lease" => round_trip::<model::Lease>(text),
        "model::ProviderStatus" => round_trip::<model::ProviderStatus>(text),
        "model::Event" => round_trip::<model::Event>(text),
        "model::Revocation" => round_trip::<model::Revocation>(text),
        "stream::ChangeMessage" => round_trip_stream(text),
        "http::ExecStart" => round_trip::<slotpool_launcher::http::exec::ExecStart>(text),
        "http::ExecControl" => round_trip::<slotpool_launcher::http::exec::ExecControl>(text),
        "http::ExecEvent" => round_trip::<slotpool_launcher::http::exec::ExecEvent>(text),
        // docs/providers.md names its examples (`<!-- example: NAME -->`); its schemas are
        // held to the code by protocol/src/provider.rs.
        "create-request" => round_trip::<provider::CreateRequest>(text),
        "created" => round_trip::<provider::Created>(text),
        "delete-request" => round_trip::<provider::DeleteRequest>(text),
        "list" => round_trip::<Vec<provider::ListedMachine>>(text),
        "console-request" => round_trip::<provider::ConsoleRequest>(text),
        "console" => round_trip::<provider::ConsoleOutput>(text),
        _ => return None,
    })
}

/// A stream message, its record decoded as the record type of its kind.
fn round_trip_stream(text: &str) -> Result<Value, String> {
    use slotpool_launcher::http::stream::{ChangeMessage, Kind};
    let message: ChangeMessage = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut value: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if let Some(record) = &message.record {
        let record = record.to_string();
        let encoded = match message.kind {
            Kind::Event => round_trip::<model::Event>(&record),
            Kind::Request => round_trip::<model::NodeRequest>(&record),
            Kind::Node => round_trip::<model::Node>(&record),
            Kind::Backing => round_trip::<model::BackingNode>(&record),
        }?;
        subset(&value["record"], &encoded, "record")?;
        value["record"] = encoded;
    }
    Ok(value)
}

/// Whether everything `example` says is in `decoded` (what the type made of it): a
/// field the type does not know, or a value it reads otherwise, is a difference.
fn subset(example: &Value, decoded: &Value, at: &str) -> Result<(), String> {
    match (example, decoded) {
        (Value::Object(e), Value::Object(d)) => {
            for (k, v) in e {
                let path = format!("{at}.{k}");
                match d.get(k) {
                    Some(dv) => subset(v, dv, &path)?,
                    None => return Err(format!("{path}: the type has no such field")),
                }
            }
            Ok(())
        }
        (Value::Array(e), Value::Array(d)) if e.len() == d.len() => {
            for (i, (ev, dv)) in e.iter().zip(d).enumerate() {
                subset(ev, dv, &format!("{at}[{i}]"))?;
            }
            Ok(())
        }
        (Value::Number(e), Value::Number(d)) if e.as_f64() == d.as_f64() => Ok(()),
        (e, d) if e == d => Ok(()),
        (e, d) => Err(format!("{at}: the example says {e}, the type reads {d}")),
    }
}

/// The contract version a versioned example must carry.
fn version_of(ty: &str) -> Option<u64> {
    use slotpool_protocol::provider::{ConsoleRequest, CreateRequest, DeleteRequest};
    if ty == "create-request" {
        Some(u64::from(CreateRequest::VERSION))
    } else if ty == "delete-request" {
        Some(u64::from(DeleteRequest::VERSION))
    } else if ty == "console-request" {
        Some(u64::from(ConsoleRequest::VERSION))
    } else if ty == "api::AgentCommand" || ty.starts_with("stream::") {
        None
    } else {
        Some(u64::from(slotpool_protocol::PROTOCOL_VERSION))
    }
}

/// Checks one example against the type its note names: `TYPE`, `reply TYPE` (the
/// reply envelope around it) or `lines TYPE` (one document a line).
fn check_example(note: &str, text: &str) -> Result<usize, String> {
    let (form, ty) = match note.split_once(' ') {
        Some((form @ ("reply" | "lines"), ty)) => (form, ty),
        _ => ("", note),
    };
    let docs: Vec<String> = if form == "lines" {
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect()
    } else {
        vec![text.to_string()]
    };
    for doc in &docs {
        let mut example: Value = serde_json::from_str(doc).map_err(|e| format!("not JSON: {e}"))?;
        if form == "reply" {
            let body = example
                .as_object()
                .filter(|o| o.len() == 1)
                .ok_or("a reply is {\"ok\": …} or {\"error\": …}")?;
            example = match (body.get("ok"), body.get("error")) {
                (Some(ok), None) => ok.clone(),
                (None, Some(err)) => {
                    let decoded = decode_as("api::ApiError", &err.to_string()).expect("known")?;
                    subset(err, &decoded, "error")?;
                    continue;
                }
                _ => return Err("a reply is {\"ok\": …} or {\"error\": …}".into()),
            };
        }
        let decoded = decode_as(ty, &example.to_string())
            .ok_or_else(|| format!("no type {ty} known to tests/tests/docs.rs"))?
            .map_err(|e| format!("does not decode as {ty}: {e}"))?;
        subset(&example, &decoded, ty)?;
        if let (Some(want), Some(v)) = (version_of(ty), example.get("v")) {
            if v.as_u64() != Some(want) {
                return Err(format!("\"v\": {v}, but {ty} is version {want}"));
            }
        }
    }
    Ok(docs.len())
}

#[test]
fn every_json_example_decodes_with_the_type_its_note_names() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for path in documents() {
        for block in blocks(&read(&path)) {
            if block.lang != "json" {
                continue;
            }
            let at = format!("{}:{}", name(&path), block.line);
            match &block.note {
                // A JSON Schema, generated from the code (protocol/src/provider.rs).
                Some((kind, _)) if kind == "schema" => {}
                Some((kind, ty)) if kind == "json" || kind == "example" => {
                    match check_example(ty, &block.text) {
                        Ok(n) => checked += n,
                        Err(e) => failures.push(format!("{at}: {e}")),
                    }
                }
                _ => failures.push(format!(
                    "{at}: a JSON example needs a `<!-- json: TYPE -->` note on the line \
                     before it (or is not JSON: mark it `text`)"
                )),
            }
        }
    }
    eprintln!("json examples decoded: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 40, "only {checked} examples found");
}

// ---- field tables -------------------------------------------------------------------

/// The fields a derived `Deserialize` of a struct asks for.
fn fields_of<T: DeserializeOwned>() -> BTreeSet<String> {
    use serde::de::{self, Visitor};
    struct Probe<'a>(&'a mut Option<&'static [&'static str]>);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("probe")
        }
    }
    impl std::error::Error for Stop {}
    impl de::Error for Stop {
        fn custom<M: std::fmt::Display>(_: M) -> Stop {
            Stop
        }
    }
    impl<'de> de::Deserializer<'de> for Probe<'_> {
        type Error = Stop;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            *self.0 = Some(fields);
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
            enum identifier ignored_any
        }
    }
    let mut got = None;
    let _ = T::deserialize(Probe(&mut got));
    got.unwrap_or_else(|| panic!("{} is not a plain struct", std::any::type_name::<T>()))
        .iter()
        .map(|f| f.to_string())
        .collect()
}

/// The keys of `value` encoded.
fn keys_of(value: impl Serialize) -> BTreeSet<String> {
    match serde_json::to_value(value).expect("encodes") {
        Value::Object(o) => o.keys().cloned().collect(),
        other => panic!("not an object: {other}"),
    }
}

/// A node with every optional field set, so that its encoding names every field (its
/// login is flattened into it, which the probe cannot see through). Written out field
/// by field: a field added to `Node` fails to compile here until it is added, and then
/// fails the table check until docs/protocol.md lists it.
fn every_field_of_a_node() -> BTreeSet<String> {
    use slotpool_protocol::{BackingId, NodeId, RequestId};
    keys_of(model::Node {
        v: 1,
        id: NodeId::parse("node-a_0_bn-a").unwrap(),
        request_id: RequestId::parse("req-a").unwrap(),
        index: 0,
        label: "small".into(),
        backing_id: BackingId::parse("bn-a").unwrap(),
        slot: 0,
        state: model::NodeState::Ready,
        requestor: "r".into(),
        client: Some(slotpool_protocol::UserName::parse("ci").unwrap()),
        host: "h".into(),
        workspace: Some("/w".into()),
        attributes: Default::default(),
        allocated_at: 1,
        released_at: Some(2),
        failure: Some("f".into()),
        login: model::SlotLogin {
            username: Some("u".into()),
            port: Some(22),
            host_keys: vec!["ssh-ed25519 AAAA".into()],
        },
    })
}

fn fields_named(ty: &str) -> Option<BTreeSet<String>> {
    Some(match ty {
        "api::SubmitRequest" => fields_of::<api::SubmitRequest>(),
        "api::ReleaseNodes" => fields_of::<api::ReleaseNodes>(),
        "api::CancelRequest" => fields_of::<api::CancelRequest>(),
        "api::KeepAlive" => fields_of::<api::KeepAlive>(),
        "exec::ExecRequest" => fields_of::<slotpool_protocol::exec::ExecRequest>(),
        "api::BackingOrder" => fields_of::<api::BackingOrder>(),
        "api::SlotLimits" => fields_of::<api::SlotLimits>(),
        "api::SlotPrepared" => {
            let mut f = fields_of::<model::SlotLogin>();
            f.insert("workspace".into());
            f
        }
        "model::NodeRequest" => fields_of::<model::NodeRequest>(),
        "model::Node" => every_field_of_a_node(),
        "model::BackingNode" => fields_of::<model::BackingNode>(),
        "model::AgentHeartbeat" => fields_of::<model::AgentHeartbeat>(),
        "model::Lease" => fields_of::<model::Lease>(),
        "model::ProviderStatus" => fields_of::<model::ProviderStatus>(),
        "model::Event" => fields_of::<model::Event>(),
        _ => return None,
    })
}

/// The tables of `text`: (line of the header, rows of cells).
fn tables(text: &str) -> Vec<(usize, Vec<Vec<String>>)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, Vec<Vec<String>>)> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with('|') {
            let cells = split_row(t);
            match &mut current {
                Some((_, rows)) => rows.push(cells),
                None => current = Some((i + 1, vec![cells])),
            }
        } else if let Some(table) = current.take() {
            out.push(table);
        }
    }
    out.extend(current);
    out
}

/// The cells of a table row, `\|` kept inside a cell.
fn split_row(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    let mut code = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().unwrap().push('|');
                chars.next();
            }
            '`' => {
                code = !code;
                cells.last_mut().unwrap().push(c);
            }
            '|' if !code => cells.push(String::new()),
            _ => cells.last_mut().unwrap().push(c),
        }
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The `code` spans of `text`.
fn code_spans(text: &str) -> Vec<String> {
    text.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_string())
        .collect()
}

#[test]
fn every_field_table_lists_exactly_the_fields_of_its_type() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for path in documents() {
        let text = read(&path);
        let lines: Vec<&str> = text.lines().collect();
        for (line, rows) in tables(&text) {
            // The note is on the line before the table (or the one before that, across
            // a blank line).
            let note = lines[..line - 1]
                .iter()
                .rev()
                .take(2)
                .find_map(|l| note_of(l))
                .filter(|(kind, _)| kind == "fields");
            let Some((_, ty)) = note else { continue };
            let at = format!("{}:{line}", name(&path));
            let Some(want) = fields_named(&ty) else {
                failures.push(format!("{at}: no type {ty} known to tests/tests/docs.rs"));
                continue;
            };
            let listed: BTreeSet<String> = rows
                .iter()
                .skip(2)
                .flat_map(|r| code_spans(&r[0]))
                .collect();
            let missing: Vec<_> = want.difference(&listed).collect();
            let extra: Vec<_> = listed.difference(&want).collect();
            if !missing.is_empty() || !extra.is_empty() {
                failures.push(format!(
                    "{at}: the table of {ty} misses {missing:?} and lists {extra:?}, which {ty} has not"
                ));
            }
            checked += 1;
        }
    }
    eprintln!("field tables checked: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 14, "only {checked} field tables found");
}

#[test]
fn every_table_is_whole() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for path in documents() {
        let text = read(&path);
        let mut in_code = false;
        let mut prose = String::new();
        for line in text.lines() {
            if line.trim_start().starts_with("```") {
                in_code = !in_code;
                prose.push('\n');
                continue;
            }
            prose.push_str(if in_code { "" } else { line });
            prose.push('\n');
        }
        for (line, rows) in tables(&prose) {
            let at = format!("{}:{line}", name(&path));
            let separator = rows.get(1).is_some_and(|r| {
                r.iter()
                    .all(|c| !c.is_empty() && c.chars().all(|ch| matches!(ch, '-' | ':')))
            });
            if !separator {
                failures.push(format!(
                    "{at}: a table row without a header and separator (a row cut off from its table by a blank line?)"
                ));
                continue;
            }
            let width = rows[0].len();
            for (i, r) in rows.iter().enumerate() {
                if r.len() != width {
                    failures.push(format!(
                        "{at}: row {} has {} cells, the header {width}",
                        i + 1,
                        r.len()
                    ));
                }
            }
            checked += 1;
        }
    }
    eprintln!("tables checked: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- options ------------------------------------------------------------------------

/// The options and environment variables of one program, by subcommand path ("" for the
/// program itself), read from its own `--help` (clap's command tree as it prints it).
#[derive(Default, Debug)]
struct Program {
    /// Subcommand path (`"list"`, `"config validate"`) → its long options.
    options: BTreeMap<String, BTreeSet<String>>,
    env: BTreeSet<String>,
}

impl Program {
    fn read(binary: &str) -> Program {
        let mut program = Program::default();
        let mut paths = vec![Vec::<String>::new()];
        while let Some(path) = paths.pop() {
            let out = std::process::Command::new(bin_path(binary))
                .args(&path)
                .arg("--help")
                .output()
                .unwrap_or_else(|e| panic!("running {binary} --help: {e}"));
            let help = String::from_utf8_lossy(&out.stdout).to_string();
            let mut options = BTreeSet::new();
            let mut in_commands = false;
            for line in help.lines() {
                if line.ends_with(':') && !line.starts_with(' ') {
                    in_commands = line == "Commands:";
                    continue;
                }
                let t = line.trim_start();
                if in_commands && line.starts_with("  ") && !line.starts_with("   ") {
                    if let Some(sub) = t.split_whitespace().next() {
                        if sub != "help" {
                            let mut p = path.clone();
                            p.push(sub.to_string());
                            paths.push(p);
                        }
                    }
                    continue;
                }
                // An option line: `  -n, --lines <N>` or `      --wait`.
                let short = t.as_bytes();
                let flag = if t.starts_with("--") {
                    Some(t)
                } else if short.len() > 6
                    && short[0] == b'-'
                    && short[1].is_ascii_alphanumeric()
                    && &t[2..6] == ", --"
                {
                    Some(&t[4..])
                } else {
                    None
                };
                if let Some(flag) = flag {
                    let long = flag
                        .split(|c: char| c.is_whitespace() || c == '=' || c == '<' || c == '[')
                        .next()
                        .unwrap();
                    options.insert(long.to_string());
                }
                let mut rest = line;
                while let Some(at) = rest.find("[env: ") {
                    rest = &rest[at + 6..];
                    let var: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit())
                        .collect();
                    program.env.insert(var);
                }
            }
            program.options.insert(path.join(" "), options);
        }
        program
    }

    /// Whether `option` is one of `sub`'s, or of a command above it (global options).
    fn takes(&self, sub: &[String], option: &str) -> bool {
        (0..=sub.len()).any(|n| {
            self.options
                .get(&sub[..n].join(" "))
                .is_some_and(|o| o.contains(option))
        })
    }

    fn all(&self) -> BTreeSet<String> {
        self.options.values().flatten().cloned().collect()
    }
}

const PROGRAMS: [&str; 4] = [
    "slotpool",
    "slotpool-agent",
    "slotpool-console",
    "slotpool-bench",
];

fn programs() -> BTreeMap<&'static str, Program> {
    PROGRAMS.iter().map(|p| (*p, Program::read(p))).collect()
}

/// Options the docs name on their own that are no slotpool program's, with why.
const NOT_OURS: [&str; 7] = [
    // `cargo test -- --nocapture`, `--ignored`: the test runner's.
    "--nocapture",
    "--ignored",
    // `cargo build --release`.
    "--release",
    // systemd-nspawn's, debootstrap's and rpm's, in the packaging test's notes.
    "--volatile",
    "--variant",
    "--scripts",
    // Named as absent: "the CLI has no `--actor`".
    "--actor",
];

/// The words of the command lines in `text`: code blocks' lines and inline spans,
/// joined across a trailing `\`.
fn command_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for block in blocks(text) {
        if matches!(block.lang.as_str(), "sh" | "text" | "" | "console") {
            let joined = block.text.replace("\\\n", " ");
            out.extend(joined.lines().map(|l| l.trim().to_string()));
        }
    }
    let mut prose = String::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    out.extend(code_spans(&prose));
    out
}

/// The options `words` names for a program, with the subcommand words before them.
fn named_options(words: &[&str]) -> (Vec<String>, Vec<String>) {
    let mut sub = Vec::new();
    let mut options = Vec::new();
    for w in words {
        let w = w.trim_matches(|c: char| {
            matches!(c, '[' | ']' | '(' | ')' | ',' | '.' | ';' | '"' | '\'')
        });
        if let Some(opt) = w.strip_prefix("--") {
            let opt: String = opt
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if !opt.is_empty() {
                options.push(format!("--{opt}"));
            }
        } else if options.is_empty()
            && !w.is_empty()
            && w.chars()
                .all(|c| c.is_ascii_lowercase() || c == '-' || c == '|')
        {
            // `hold|drain|run`: alternatives that take the same options.
            sub.push(w.split('|').next().unwrap().to_string());
        }
    }
    (sub, options)
}

#[test]
fn every_option_the_docs_name_is_one_the_programs_take() {
    let programs = programs();
    let everything: BTreeSet<String> = programs.values().flat_map(|p| p.all()).collect();
    let subcommands: BTreeSet<String> = programs["slotpool"]
        .options
        .keys()
        .filter_map(|k| k.split(' ').next().map(str::to_string))
        .filter(|k| !k.is_empty())
        .collect();
    let mut checked = 0;
    let mut failures = Vec::new();
    for path in documents() {
        for line in command_lines(&read(&path)) {
            let words: Vec<&str> = line.split_whitespace().collect();
            let Some(first) = words.first() else { continue };
            let first = first.trim_start_matches("$ ");
            let (program, rest) = if let Some(p) = programs.get(first) {
                (Some(p), &words[1..])
            } else if subcommands.contains(first) {
                // `serve --http ADDR`: a slotpool subcommand named on its own.
                (Some(&programs["slotpool"]), &words[..])
            } else if first.starts_with("--") {
                (None, &words[..])
            } else {
                continue;
            };
            let (sub, options) = named_options(rest);
            // `slotpool bench`: the benchmark before it became `slotpool-bench`, in
            // docs/benchmarks.md's notes of old runs.
            if first == "slotpool" && sub.first().is_some_and(|s| s == "bench") {
                continue;
            }
            for option in options {
                if NOT_OURS.contains(&option.as_str()) {
                    continue;
                }
                checked += 1;
                let known = match program {
                    Some(p) => p.takes(&sub, &option),
                    None => everything.contains(&option),
                };
                if !known {
                    failures.push(format!(
                        "{}: `{line}` names {option}, which {} does not take",
                        name(&path),
                        match program {
                            Some(_) => format!("`{first} {}`", sub.join(" ")),
                            None => "no slotpool program".to_string(),
                        }
                    ));
                }
            }
        }
    }
    eprintln!("options named in the docs checked: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 150, "only {checked} options found");
}

/// The `SLOTPOOL_` variables the shipped shell scripts read (`$VAR`, `${VAR...}`): the
/// GitLab Runner driver's and the scripts the docs give under `<!-- script: NAME -->`.
fn read_by_shipped_scripts() -> BTreeSet<String> {
    let mut texts: Vec<String> = std::fs::read_dir(repo().join("packaging/gitlab-runner"))
        .expect("packaging/gitlab-runner/")
        .map(|e| read(&e.expect("an entry").path()))
        .collect();
    for path in documents() {
        texts.extend(
            blocks(&read(&path))
                .into_iter()
                .filter(|b| b.note.as_ref().is_some_and(|(kind, _)| kind == "script"))
                .map(|b| b.text),
        );
    }
    let mut vars = BTreeSet::new();
    for text in texts {
        for prefix in ["${SLOTPOOL_", "$SLOTPOOL_"] {
            for (at, _) in text.match_indices(prefix) {
                let name: String = text[at + prefix.len() - "SLOTPOOL_".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit())
                    .collect();
                vars.insert(name);
            }
        }
    }
    vars
}

#[test]
fn the_reference_pages_name_every_option_and_every_variable() {
    let programs = programs();
    let cli = read(&repo().join("docs/cli.md"));
    let http = read(&repo().join("docs/http.md"));
    let mut failures = Vec::new();
    let mut checked = 0;
    for (program, p) in &programs {
        // The benchmark is a development tool: docs/benchmarks.md is its page.
        // Each program's own section of docs/cli.md: an option named for another
        // program does not count.
        let section = |from: &str, to: Option<&str>| -> String {
            let start = cli
                .find(from)
                .unwrap_or_else(|| panic!("docs/cli.md has no {from:?}"));
            let rest = &cli[start..];
            match to.and_then(|t| rest.find(t)) {
                Some(end) => rest[..end].to_string(),
                None => rest.to_string(),
            }
        };
        let page = match *program {
            "slotpool-bench" => read(&repo().join("docs/benchmarks.md")),
            "slotpool-agent" => section("## `slotpool-agent`", None),
            // The console takes the NATS options "as above": the slotpool section's table.
            "slotpool-console" => {
                section("## `slotpool-console`", Some("## `slotpool-agent`"))
                    + &section(
                        "NATS options, for every subcommand",
                        Some("## `slotpool-console`"),
                    )
            }
            _ => section("## `slotpool`", Some("## `slotpool-console`")),
        };
        for (sub, options) in &p.options {
            for option in options {
                if matches!(option.as_str(), "--help" | "--version") {
                    continue;
                }
                checked += 1;
                if !page.contains(option.as_str()) {
                    failures.push(format!(
                        "`{program} {sub}` takes {option}, which its page does not name"
                    ));
                }
            }
        }
        for var in &p.env {
            checked += 1;
            if !page.contains(var.as_str())
                && !read(&repo().join("docs/operations.md")).contains(var.as_str())
            {
                failures.push(format!(
                    "{program} reads {var}, which its page does not name"
                ));
            }
        }
    }
    // The HTTP listener's page names every option of it.
    for option in programs["slotpool"].options["serve"]
        .iter()
        .filter(|o| o.starts_with("--http"))
    {
        checked += 1;
        if !http.contains(option.as_str()) {
            failures.push(format!("docs/http.md does not name `serve {option}`"));
        }
    }
    // Every SLOTPOOL_ variable the docs name is one a program reads, or one of these.
    let read_elsewhere = [
        "SLOTPOOL_AGENT_SECRET",     // the agent's secret (never an option)
        "SLOTPOOL_NATS_SERVER",      // the scripts' and tests' nats-server
        "SLOTPOOL_NATS_PY",          // the tests' Python with nats-py
        "SLOTPOOL_CHAOS_SEED",       // tests/tests/chaos.rs
        "SLOTPOOL_DEMO_SSH_KEY",     // written by the demo's env file
        "SLOTPOOL_BENCH_AGENT_ARGS", // tests/tests/slot_timing.rs
        "SLOTPOOL_NODES",            // set by `slotpool exec` for the command it runs
        "SLOTPOOL_HOSTS",            // set by `slotpool exec` for the command it runs
    ];
    let mut env: BTreeSet<String> = programs
        .values()
        .flat_map(|p| p.env.iter().cloned())
        .collect();
    env.extend(read_by_shipped_scripts());
    for path in documents() {
        let text = read(&path);
        for (at, _) in text.match_indices("SLOTPOOL_") {
            let raw: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            // `SLOTPOOL_NATS_TLS_*`, `SLOTPOOL_*`: a family, not a variable.
            if text[at + raw.len()..].starts_with('*') {
                continue;
            }
            let var = raw.trim_end_matches('_');
            checked += 1;
            if !env.contains(var) && !read_elsewhere.contains(&var) {
                failures.push(format!(
                    "{}: names {var}, which no slotpool program reads",
                    name(&path)
                ));
            }
        }
    }
    eprintln!("options and variables checked against the reference pages: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- the pool file ------------------------------------------------------------------

/// A pool file that validates, with `extra` inserted as a key at `level`.
fn pool_file(level: &str, extra: &str) -> String {
    let at = |l: &str| if l == level { extra } else { "" };
    format!(
        "launcher:\n  lease-ttl: 10\n  {launcher}\nproviders:\n\
         - name: lab\n  driver: static\n  {provider}\n  static:\n    {static_}\n    hosts:\n\
         \x20     - name: h1\n        host: 192.0.2.1\n        secret-file: /nonexistent\n        {host}\n\
         \x20 pools:\n    - name: p\n      max-servers: 1\n      {pool}\n      labels:\n\
         \x20       - name: small\n          backing-label: host\n          max-parallel-jobs: 2\n          limits:\n            cpu: 1\n            {limits}\n          {label}\n\
         - name: cloud\n  driver: exec\n  exec:\n    create: [c]\n    delete: [d]\n    list: [l]\n    {exec}\n\
         \x20 pools:\n    - name: q\n      max-servers: 1\n      labels:\n\
         \x20       - name: big\n          sizes:\n            - backing-label: a\n              max-parallel-jobs: 2\n              cost-per-hour: 1\n              {sizes}\n\
         - name: here\n  driver: local\n  local:\n    work-dir: /tmp\n    {local}\n  pools:\n    - name: r\n      max-servers: 1\n      labels:\n\
         \x20       - name: tiny\n          backing-label: x\n          max-parallel-jobs: 1\n\
         tenants:\n  - name: t\n    clients: [ci-t]\n    {tenants}\n{top}",
        launcher = at("launcher"),
        provider = at("providers[]"),
        static_ = at("static"),
        host = at("static.hosts[]"),
        pool = at("providers[].pools[]"),
        label = at("providers[].pools[].labels[]"),
        limits = at("labels[].limits"),
        exec = at("exec"),
        sizes = at("labels[].sizes[]"),
        local = at("local"),
        tenants = at("tenants[]"),
        top = if level.is_empty() { extra } else { "" },
    )
}

/// The pool file's levels as docs/configuration.md heads them ("" is the file itself).
const LEVELS: [&str; 12] = [
    "",
    "launcher",
    "providers[]",
    "exec",
    "static",
    "static.hosts[]",
    "local",
    "providers[].pools[]",
    "providers[].pools[].labels[]",
    "labels[].sizes[]",
    "labels[].limits",
    "tenants[]",
];

/// The keys the parser takes at `level`: it names them when it refuses an unknown one.
fn schema_keys(level: &str) -> BTreeSet<String> {
    use slotpool_config::Config;
    let file = Path::new("pool.yaml");
    Config::parse(file, &pool_file(level, ""))
        .unwrap_or_else(|e| panic!("the probe pool file does not validate: {e}"));
    let err = Config::parse(file, &pool_file(level, "zz-probe: 1\n"))
        .expect_err("an unknown key is refused")
        .to_string();
    let expected = err
        .split_once("expected one of ")
        .or_else(|| err.split_once("expected "))
        .unwrap_or_else(|| panic!("the parser does not list the keys of {level:?}: {err}"))
        .1;
    expected
        .split(", ")
        .map(|k| k.trim().trim_matches('`').to_string())
        .collect()
}

#[test]
fn the_configuration_page_and_the_example_name_exactly_the_keys_the_parser_takes() {
    let page = read(&repo().join("docs/configuration.md"));
    let mut by_heading: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut heading = String::new();
    let mut in_code = false;
    for line in page.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if in_code {
        } else if let Some(h) = line.strip_prefix('#') {
            let h = h.trim_start_matches('#').trim();
            heading = match h {
                "The file" => String::new(),
                _ => code_spans(h)
                    .into_iter()
                    .next()
                    .unwrap_or_else(|| h.to_string()),
            };
        } else if line.starts_with("| `") {
            let first = &split_row(line)[0];
            by_heading
                .entry(heading.clone())
                .or_default()
                .extend(code_spans(first));
        }
    }
    let example = read(&repo().join("examples/pool.yaml"));
    // Keys as written: `key:` at the start of a line or list item, or in a `{...}` map.
    let example_keys: BTreeSet<String> = example
        .lines()
        .map(|l| l.split(" #").next().unwrap().trim())
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            l.trim_start_matches("- ")
                .split(['{', ','])
                .filter_map(|p| {
                    let (k, _) = p.split_once(':')?;
                    let k = k.trim();
                    k.chars()
                        .all(|c| c.is_ascii_lowercase() || c == '-')
                        .then(|| k.to_string())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let mut failures = Vec::new();
    let mut checked = 0;
    for level in LEVELS {
        let want = schema_keys(level);
        let listed = by_heading.remove(level).unwrap_or_default();
        let missing: Vec<_> = want.difference(&listed).collect();
        let extra: Vec<_> = listed.difference(&want).collect();
        if !missing.is_empty() || !extra.is_empty() {
            failures.push(format!(
                "docs/configuration.md, `{level}`: misses {missing:?} and names {extra:?}, which the parser does not take there"
            ));
        }
        for key in &want {
            checked += 1;
            if !example_keys.contains(key) {
                failures.push(format!(
                    "examples/pool.yaml does not use `{key}` (of `{level}`)"
                ));
            }
        }
    }
    for (heading, keys) in by_heading {
        failures.push(format!(
            "docs/configuration.md: a table of keys under {heading:?}, which is no level of the file: {keys:?}"
        ));
    }
    slotpool_config::Config::parse(Path::new("examples/pool.yaml"), &example)
        .unwrap_or_else(|e| panic!("examples/pool.yaml does not validate: {e}"));
    eprintln!(
        "pool-file keys checked: {checked} (in {} levels)",
        LEVELS.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- facts, subjects, pictures ------------------------------------------------------

/// `n` with thousands separated by commas, as the docs write numbers.
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[test]
fn the_limits_the_docs_give_are_the_codes() {
    let protocol = read(&repo().join("docs/protocol.md"));
    let row = |field: &str| -> String {
        protocol
            .lines()
            .find(|l| l.starts_with(&format!("| `{field}` |")))
            .unwrap_or_else(|| panic!("docs/protocol.md has no row of `{field}`"))
            .to_string()
    };
    let facts = [
        (
            row("ssh_public_key"),
            format!(
                "at most {} bytes",
                thousands(slotpool_protocol::ssh_key::MAX_KEY_LEN)
            ),
        ),
        (
            protocol.clone(),
            format!(
                "larger than {} bytes",
                thousands(slotpool_protocol::MAX_MESSAGE_BYTES)
            ),
        ),
    ];
    for (text, fact) in &facts {
        assert!(
            text.contains(fact.as_str()),
            "docs/protocol.md does not say {fact:?} (the code's limit) in: {}",
            text.chars().take(300).collect::<String>()
        );
    }
    eprintln!("limits checked: {}", facts.len());
}

#[test]
fn every_api_subject_has_its_section() {
    let protocol = read(&repo().join("docs/protocol.md"));
    let headings: Vec<&str> = protocol.lines().filter(|l| l.starts_with("### ")).collect();
    let mut failures = Vec::new();
    let mut checked = 0;
    for line in protocol
        .lines()
        .filter(|l| l.starts_with("| `slotpool.api.v2.<client>."))
    {
        let op = line["| `slotpool.api.v2.<client>.".len()..]
            .split('`')
            .next()
            .unwrap();
        checked += 1;
        if !headings
            .iter()
            .any(|h| h.contains(&format!(".{op}`")) || h.contains(&format!("`.{op}`")))
        {
            failures.push(format!(
                "docs/protocol.md: `{op}` has no section of its own"
            ));
        }
    }
    eprintln!("API subjects with a section: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn no_code_names_a_retired_subject() {
    let mut failures = Vec::new();
    for dir in [
        "protocol/src",
        "launcher/src",
        "agent/src",
        "tui/src",
        "config/src",
    ] {
        let mut stack = vec![repo().join(dir)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    for (i, l) in read(&p).lines().enumerate() {
                        if l.contains("slotpool.agent.v1") || l.contains("slotpool.admin.v1.*") {
                            failures.push(format!("{}:{}: {}", name(&p), i + 1, l.trim()));
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "retired subjects named:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_picture_is_drawn_from_its_source() {
    let dir = repo().join("docs/diagrams");
    let mut checked = 0;
    for e in std::fs::read_dir(&dir).expect("docs/diagrams").flatten() {
        let dot = e.path();
        if dot.extension().is_none_or(|x| x != "dot") {
            continue;
        }
        // Graphviz writes some characters as entities.
        let svg = read(&dot.with_extension("svg"))
            .replace("&#45;", "-")
            .replace("&#39;", "'")
            .replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&");
        for label in read(&dot)
            .split("label=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap())
        {
            for part in label.split("\\n") {
                checked += 1;
                assert!(
                    svg.contains(part),
                    "{} lacks {part:?} of {}: run docs/diagrams/render.sh",
                    name(&dot.with_extension("svg")),
                    name(&dot)
                );
            }
        }
    }
    eprintln!("diagram labels found in their pictures: {checked}");
    assert!(checked > 20);
}

#[test]
fn the_exit_statuses_the_docs_give_are_the_programs() {
    let out = std::process::Command::new(bin_path("slotpool"))
        .arg("--help")
        .output()
        .expect("slotpool --help");
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    let from_help: BTreeSet<(String, String)> = help
        .split("Exit status:\n")
        .nth(1)
        .expect("`slotpool --help` lists the exit statuses")
        .lines()
        .filter_map(|l| {
            let (code, meaning) = l.trim().split_once(' ')?;
            Some((code.to_string(), meaning.trim().to_string()))
        })
        .collect();
    let cli = read(&repo().join("docs/cli.md"));
    let table = cli
        .split("**Exit statuses**")
        .nth(1)
        .expect("docs/cli.md's exit statuses");
    let from_docs: BTreeSet<(String, String)> = tables(table)[0]
        .1
        .iter()
        .skip(2)
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect();
    assert_eq!(from_docs, from_help);
    eprintln!("exit statuses checked: {}", from_help.len());
}

/// The wire name of a unit enum value (`"over_limit"`).
fn wire_name(value: impl Serialize) -> String {
    serde_json::to_value(value)
        .unwrap()
        .as_str()
        .expect("a unit variant")
        .to_string()
}

#[test]
fn the_error_code_table_lists_exactly_the_codes() {
    let text = read(&repo().join("docs/protocol.md"));
    let (at, rows) = tables(&text)
        .into_iter()
        .find(|(_, rows)| rows[0].first().is_some_and(|c| c == "Code"))
        .expect("docs/protocol.md has the error code table");
    let listed: Vec<String> = rows[2..]
        .iter()
        .map(|r| r[0].trim_matches('`').to_string())
        .collect();
    let codes: Vec<String> = api::ErrorCode::ALL.into_iter().map(wire_name).collect();
    assert_eq!(
        listed, codes,
        "docs/protocol.md:{at}: the error code table against api::ErrorCode::ALL"
    );
}

#[test]
fn the_wait_causes_the_docs_name_are_the_codes() {
    let causes: BTreeSet<String> = model::WaitCause::ALL
        .into_iter()
        .map(|c| {
            assert_eq!(wire_name(c), c.name(), "the wire name is the metric's");
            c.name().to_string()
        })
        .collect();
    // The metric's label values: `queued` and every cause.
    let ops = read(&repo().join("docs/operations.md"));
    let row = ops
        .lines()
        .find(|l| l.starts_with("| `slotpool_requests_waiting_by_cause`"))
        .expect("docs/operations.md lists slotpool_requests_waiting_by_cause");
    let mut named: BTreeSet<String> = code_spans(&split_row(row)[1]).into_iter().collect();
    assert!(named.remove("queued"), "{row}");
    assert_eq!(named, causes, "docs/operations.md: {row}");
    // docs/protocol.md's Waiting paragraph says what each one means.
    let protocol = read(&repo().join("docs/protocol.md"));
    let start = protocol.find("**Waiting**").expect("the Waiting paragraph");
    let paragraph = &protocol[start..start + protocol[start..].find("\n\n").unwrap()];
    let said: BTreeSet<String> = code_spans(paragraph)
        .into_iter()
        .filter(|s| causes.contains(s))
        .collect();
    assert_eq!(said, causes, "docs/protocol.md's Waiting paragraph");
}

/// The table of attacks in docs/isolation.md names, in each row, the tests that prove it
/// (`` `path::name` ``): each is a test function of that file.
#[test]
fn every_test_the_isolation_table_names_exists() {
    let doc = read(&repo().join("docs/isolation.md"));
    let after = doc
        .split("<!-- attacks: each row names the tests that prove it -->")
        .nth(1)
        .expect("docs/isolation.md's table of attacks");
    let (_, rows) = &tables(after)[0];
    let mut named = 0;
    for row in rows.iter().skip(2) {
        let cell = row.last().expect("a tests column");
        let tests: Vec<&str> = cell
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|t| t.contains("::"))
            .collect();
        assert!(!tests.is_empty(), "a row names no test: {row:?}");
        for test in tests {
            let (file, function) = test.split_once("::").expect("path::name");
            let source = read(&repo().join(file));
            let lines: Vec<&str> = source.lines().collect();
            let at = lines
                .iter()
                .position(|l| {
                    l.trim_start()
                        .strip_prefix("async fn ")
                        .or_else(|| l.trim_start().strip_prefix("fn "))
                        .is_some_and(|rest| rest.starts_with(&format!("{function}(")))
                })
                .unwrap_or_else(|| panic!("{file} has no fn {function}"));
            let attributes = &lines[at.saturating_sub(3)..at];
            assert!(
                attributes
                    .iter()
                    .any(|l| l.trim_start().starts_with("#[") && l.contains("test")),
                "{file}: {function} is not a test"
            );
            named += 1;
        }
    }
    eprintln!(
        "attacks in the isolation table: {}, tests named: {named}",
        rows.len() - 2
    );
}

/// The contract for sending a call again (docs/protocol.md) names the client's resend
/// wait and time-out and how long a launcher remembers a released node, as the code
/// holds them.
#[test]
fn the_resend_contract_states_the_codes_figures() {
    use slotpool_launcher::world::released::{MAX_REMEMBERED, REMEMBERED_MS};
    use slotpool_protocol::client::{API_RESEND, API_TIMEOUT};
    let text = read(&repo().join("docs/protocol.md"));
    let start = text.find("### Sending a call again").expect("the section");
    let section = &text[start..];
    let section = &section[..section.find("\n---").unwrap_or(section.len())];
    let remembered = |n: usize| {
        let digits = n.to_string();
        let (head, tail) = digits.split_at(digits.len() % 3);
        let groups: Vec<&str> = tail
            .as_bytes()
            .chunks(3)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        [head]
            .into_iter()
            .chain(groups)
            .filter(|g| !g.is_empty())
            .collect::<Vec<_>>()
            .join(",")
    };
    for fact in [
        format!("**{} s**", API_RESEND.as_secs()),
        format!("`API_RESEND`, {} s", API_RESEND.as_secs()),
        format!("`API_TIMEOUT`, {} s", API_TIMEOUT.as_secs()),
        format!("for {} minutes", REMEMBERED_MS / 60_000),
        format!("at most {} of them", remembered(MAX_REMEMBERED)),
    ] {
        assert!(
            section.contains(&fact),
            "docs/protocol.md's resend contract does not say {fact:?}"
        );
    }
}
