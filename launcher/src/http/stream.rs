//! `GET /api/v1/stream`: every change to the event log, the requests, the nodes (slots)
//! and the backing nodes as one JSON text message each over a WebSocket, from a position
//! a client can resume at (docs/http.md).
//!
//! A position ([`Cursor`]) is the last revision taken from each of the four buckets; a
//! message carries the position just after it, and resuming from it reads each bucket
//! on from its own revision, so nothing is missed or repeated. Each bucket is read by
//! its own pull consumer (`Store::changes_after`): what a slow client has not taken yet
//! waits on the server, and a client that takes nothing for [`SEND_LIMIT`] is closed
//! with the position to resume from.
//!
//! A client ([`Caller::Client`]) streams its own requests and nodes only: the records
//! whose `client` is its name, and the removal of a key only once this stream has sent
//! that key as the client's (a removal names only its key).

use super::auth::Caller;
use crate::shared::Shared;
use futures::{SinkExt, Stream, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use slotpool_protocol::model::{BackingNode, Event, Node, NodeRequest};
use slotpool_protocol::store::{Change, KvError, Store};
use slotpool_protocol::{BackingId, NodeId, RequestId, UserName};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::pin::Pin;
use std::time::Duration;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

/// How long one message may wait for the client to take it before the client counts as
/// too far behind and is closed.
const SEND_LIMIT: Duration = Duration::from_secs(10);
/// How often an idle stream pings its client, so a vanished client is noticed.
const PING_EVERY: Duration = Duration::from_secs(20);
/// How long a closing handshake may take before the connection is dropped.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// What a change is about: the bucket it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Event,
    Request,
    Node,
    Backing,
}

impl Kind {
    /// In the order of a [`Cursor`]'s revisions.
    const ALL: [Kind; 4] = [Kind::Event, Kind::Request, Kind::Node, Kind::Backing];

    fn name(self) -> &'static str {
        match self {
            Kind::Event => "event",
            Kind::Request => "request",
            Kind::Node => "node",
            Kind::Backing => "backing",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    fn store(self, shared: &Shared) -> &Store {
        match self {
            Kind::Event => &shared.bus.events,
            Kind::Request => &shared.bus.requests,
            Kind::Node => &shared.bus.slots,
            Kind::Backing => &shared.bus.backing,
        }
    }
}

/// A position in the stream: per bucket ([`Kind::ALL`]'s order) the last revision
/// delivered or passed over. Written as the four numbers joined by dots; clients treat it
/// as opaque.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor([u64; 4]);

impl Cursor {
    fn get(&self, kind: Kind) -> u64 {
        self.0[kind as usize]
    }

    fn set(&mut self, kind: Kind, revision: u64) {
        self.0[kind as usize] = revision;
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [e, r, n, b] = self.0;
        write!(f, "{e}.{r}.{n}.{b}")
    }
}

impl std::str::FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Cursor, String> {
        let parts: Vec<_> = s.split('.').map(str::parse::<u64>).collect();
        match parts[..] {
            [Ok(e), Ok(r), Ok(n), Ok(b)] => Ok(Cursor([e, r, n, b])),
            _ => Err(format!(
                "bad position after={s:?}: give the `cursor` of the last message received \
                 (four numbers joined by dots)"
            )),
        }
    }
}

/// Where a stream starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// After the last change made before the stream opened.
    Now,
    /// With the oldest change the buckets still hold.
    Oldest,
    /// After a position a client was given.
    After(Cursor),
}

/// Which changes a client wants; every filter given must match.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filter {
    request: Option<RequestId>,
    node: Option<NodeId>,
    backing: Option<BackingId>,
    label: Option<String>,
    kinds: Option<Vec<Kind>>,
    /// Only the records of this bus client (not a query parameter: who is asking).
    client: Option<UserName>,
}

/// The query of a stream: where it starts and what it keeps.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub start: Start,
    pub filter: Filter,
}

const ACCEPTED: &str = "after, from, request, node, backing, label, kind";

/// The kinds a client ([`Caller::Client`]) may stream.
const CLIENT_KINDS: [Kind; 2] = [Kind::Request, Kind::Node];

impl Params {
    /// These parameters for `caller`: a client streams its own requests and nodes and
    /// nothing else; the refusal says why.
    pub fn for_caller(mut self, caller: Caller) -> Result<Params, String> {
        let Caller::Client(name) = caller else {
            return Ok(self);
        };
        match &self.filter.kinds {
            Some(kinds) => {
                if let Some(k) = kinds.iter().find(|k| !CLIENT_KINDS.contains(k)) {
                    return Err(format!(
                        "kind={}: a client streams its own requests and nodes only",
                        k.name()
                    ));
                }
            }
            None => self.filter.kinds = Some(CLIENT_KINDS.to_vec()),
        }
        self.filter.client = Some(name);
        Ok(self)
    }
}

/// Reads the query string of `/api/v1/stream`; the refusal says what was wrong and what
/// is accepted.
pub fn parse_query(query: Option<&str>) -> Result<Params, String> {
    let mut seen = BTreeMap::new();
    for (name, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if seen.insert(name.to_string(), value.to_string()).is_some() {
            return Err(format!("parameter {name:?} given twice"));
        }
    }
    let mut params = Params {
        start: Start::Now,
        filter: Filter::default(),
    };
    for (name, value) in &seen {
        match name.as_str() {
            "after" => params.start = Start::After(value.parse()?),
            "from" => match value.as_str() {
                "now" => {}
                "start" => params.start = Start::Oldest,
                other => {
                    return Err(format!(
                        "bad from={other:?}: `start` (the oldest change held) or `now`"
                    ))
                }
            },
            "request" => params.filter.request = Some(id("request", value, RequestId::parse)?),
            "node" => params.filter.node = Some(id("node", value, NodeId::parse)?),
            "backing" => params.filter.backing = Some(id("backing", value, BackingId::parse)?),
            "label" if !value.is_empty() => params.filter.label = Some(value.clone()),
            "label" => return Err("empty label=: give a label name".to_string()),
            "kind" => {
                let kinds = value
                    .split(',')
                    .map(|k| {
                        Kind::parse(k).ok_or_else(|| {
                            format!(
                                "unknown kind {k:?}: one or more of event, request, node, \
                                 backing, joined by commas"
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                params.filter.kinds = Some(kinds);
            }
            other => {
                return Err(format!(
                    "unknown parameter {other:?}: accepted are {ACCEPTED}"
                ))
            }
        }
    }
    if seen.contains_key("after") && seen.contains_key("from") {
        return Err("give either after= or from=, not both".to_string());
    }
    Ok(params)
}

fn id<T, E: fmt::Display>(
    what: &str,
    value: &str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<T, String> {
    parse(value).map_err(|err| format!("bad {what}={value:?}: {err}"))
}

/// What one change is about, for the filters.
#[derive(Debug, Default)]
struct About {
    request: Option<String>,
    nodes: Vec<String>,
    backing: Option<String>,
    labels: Vec<String>,
    /// The bus client whose record it is (requests and nodes).
    client: Option<String>,
}

impl About {
    /// From the record, or from the key alone for a removal or a record that cannot be
    /// read: a request's key is its id, a slot's names its backing node (not its node:
    /// a node id is new with each allocation of the slot).
    fn of(kind: Kind, key: &str, value: Option<&[u8]>) -> About {
        let decoded = value.and_then(|v| About::decode(kind, v));
        decoded.unwrap_or_else(|| match kind {
            Kind::Request => About {
                request: Some(key.to_string()),
                ..About::default()
            },
            Kind::Node => About {
                backing: slotpool_protocol::layout::parse_slot_key(key)
                    .map(|(backing, _)| backing.to_string()),
                ..About::default()
            },
            Kind::Event | Kind::Backing => About::default(),
        })
    }

    fn decode(kind: Kind, value: &[u8]) -> Option<About> {
        Some(match kind {
            Kind::Event => {
                let e: Event = serde_json::from_slice(value).ok()?;
                About {
                    nodes: e.node_id.iter().map(ToString::to_string).collect(),
                    backing: e.backing_id.map(|b| b.to_string()),
                    ..About::default()
                }
            }
            Kind::Request => {
                let r: NodeRequest = serde_json::from_slice(value).ok()?;
                About {
                    request: Some(r.id.to_string()),
                    nodes: r.nodes.iter().map(ToString::to_string).collect(),
                    backing: None,
                    labels: r.labels,
                    client: r.client.map(|c| c.to_string()),
                }
            }
            Kind::Node => {
                let n: Node = serde_json::from_slice(value).ok()?;
                About {
                    request: Some(n.request_id.to_string()),
                    nodes: vec![n.id.to_string()],
                    backing: Some(n.backing_id.to_string()),
                    labels: vec![n.label],
                    client: n.client.map(|c| c.to_string()),
                }
            }
            Kind::Backing => {
                let b: BackingNode = serde_json::from_slice(value).ok()?;
                About {
                    backing: Some(b.id.to_string()),
                    labels: vec![b.label],
                    ..About::default()
                }
            }
        })
    }
}

impl Filter {
    fn keeps(&self, kind: Kind, about: &About) -> bool {
        self.kinds.as_ref().is_none_or(|k| k.contains(&kind))
            && self
                .request
                .as_ref()
                .is_none_or(|r| about.request.as_deref() == Some(r.as_str()))
            && self
                .node
                .as_ref()
                .is_none_or(|n| about.nodes.iter().any(|m| m == n.as_str()))
            && self
                .backing
                .as_ref()
                .is_none_or(|b| about.backing.as_deref() == Some(b.as_str()))
            && self.label.as_ref().is_none_or(|l| about.labels.contains(l))
    }
}

/// One message of the stream, as a client reads it (docs/http.md; its examples are
/// decoded with this type). What the server writes is [`Out`]; a unit test holds the two
/// to the same fields.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangeMessage {
    pub kind: Kind,
    pub key: String,
    pub revision: u64,
    pub cursor: String,
    #[serde(default)]
    pub record: Option<serde_json::Value>,
    #[serde(default)]
    pub removed: bool,
}

/// One message of the stream, as the server writes it.
#[derive(Serialize)]
struct Out<'a> {
    kind: Kind,
    key: &'a str,
    revision: u64,
    /// Where to resume to get what comes after this message.
    cursor: String,
    /// The record as KV holds it; absent for a removal.
    #[serde(skip_serializing_if = "Option::is_none")]
    record: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    removed: bool,
}

/// The keys a client's stream has sent as the client's, whose removal it may send.
type Sent = HashSet<(Kind, String)>;

/// The message for `change`, if the filter keeps it (and, for a client's stream, if it
/// is the client's: `sent` tracks its keys).
fn message(
    kind: Kind,
    change: &Change,
    cursor: &Cursor,
    filter: &Filter,
    sent: &mut Sent,
) -> Option<String> {
    let (key, revision, value) = match change {
        Change::Put {
            key,
            revision,
            value,
        } => (key, *revision, Some(&value[..])),
        Change::Removed { key, revision } => (key, *revision, None),
        Change::Synced => return None,
    };
    let about = About::of(kind, key, value);
    if let Some(client) = &filter.client {
        let mine = match value {
            Some(_) => about.client.as_deref() == Some(client.as_str()),
            // A removal names only its key: the client's if this stream sent it so.
            None => sent.contains(&(kind, key.clone())),
        };
        if !mine || value.is_none() {
            sent.remove(&(kind, key.clone()));
        }
        if !mine {
            return None;
        }
        if value.is_some() && filter.keeps(kind, &about) {
            sent.insert((kind, key.clone()));
        }
    }
    if !filter.keeps(kind, &about) {
        return None;
    }
    let record = value.and_then(|v| serde_json::from_slice::<&RawValue>(v).ok());
    serde_json::to_string(&Out {
        kind,
        key,
        revision,
        cursor: cursor.to_string(),
        record,
        removed: value.is_none(),
    })
    .ok()
}

/// Why a stream cannot be opened: the HTTP status and what to tell the client.
#[derive(Debug)]
pub enum Refusal {
    BadRequest(String),
    /// The position is older than what the event log still holds.
    Gone(String),
    Unavailable(String),
}

type Changes = Pin<Box<dyn Stream<Item = (Kind, Result<Change, KvError>)> + Send>>;

/// A stream ready to be handed its WebSocket: its readers are open, so "now" is the
/// moment of the request, not of the upgrade.
pub struct Opened {
    cursor: Cursor,
    filter: Filter,
    changes: Changes,
}

/// Checks the position against what the buckets hold and opens one reader per bucket.
pub async fn open(shared: &Shared, params: Params) -> Result<Opened, Refusal> {
    let mut cursor = Cursor::default();
    let mut readers = Vec::new();
    for kind in Kind::ALL {
        let store = kind.store(shared);
        let (first, last) = store
            .held_revisions()
            .await
            .map_err(|err| Refusal::Unavailable(err.to_string()))?;
        let after = match params.start {
            Start::Now => last,
            Start::Oldest => first.saturating_sub(1),
            Start::After(c) => c.get(kind),
        };
        if after > last {
            return Err(Refusal::BadRequest(format!(
                "position after={}: the {} revision {after} is beyond the last one written \
                 ({last}); was it given by another installation?",
                params_cursor(&params),
                kind.name()
            )));
        }
        // Only the event log drops records by age and size; a gap in the others is a
        // value superseded by a later one, which the stream delivers.
        if kind == Kind::Event && first > after + 1 && matches!(params.start, Start::After(_)) {
            return Err(Refusal::Gone(format!(
                "position after={}: the event log no longer holds revisions {}..{}; \
                 start again with from=start or without a position",
                params_cursor(&params),
                after + 1,
                first - 1
            )));
        }
        cursor.set(kind, after);
        let changes = store
            .changes_after(after)
            .await
            .map_err(|err| Refusal::Unavailable(err.to_string()))?;
        readers.push(changes.map(move |c| (kind, c)).boxed());
    }
    Ok(Opened {
        cursor,
        filter: params.filter,
        changes: futures::stream::select_all(readers).boxed(),
    })
}

fn params_cursor(params: &Params) -> String {
    match params.start {
        Start::After(c) => c.to_string(),
        Start::Now | Start::Oldest => String::new(),
    }
}

/// How a stream ended, for its close frame.
enum End {
    /// The client closed or vanished: nothing more to say.
    ClientGone,
    Close(CloseCode, String),
}

/// Sends `opened`'s changes over the upgraded connection until the client leaves, falls
/// too far behind, a bucket cannot be read or the launcher shuts down.
pub async fn run(upgraded: Upgraded, opened: Opened, shutdown: CancellationToken) {
    let mut ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
    let end = follow(&mut ws, opened, &shutdown).await;
    if let End::Close(code, reason) = end {
        tracing::debug!(%reason, "closing a change stream");
        let frame = CloseFrame {
            code,
            reason: reason.into(),
        };
        let _ = tokio::time::timeout(CLOSE_LIMIT, async {
            if ws.close(Some(frame)).await.is_ok() {
                // Read until the client's answer, so the close is orderly.
                while let Some(Ok(_)) = ws.next().await {}
            }
        })
        .await;
    }
}

async fn follow(
    ws: &mut WebSocketStream<TokioIo<Upgraded>>,
    opened: Opened,
    shutdown: &CancellationToken,
) -> End {
    let Opened {
        mut cursor,
        filter,
        mut changes,
    } = opened;
    let mut sent = Sent::new();
    let resume = |cursor: &Cursor| format!("resume with after={cursor}");
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.reset();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                return End::Close(
                    CloseCode::Away,
                    format!("shutting down; {}", resume(&cursor)),
                );
            }
            incoming = ws.next() => match incoming {
                // Pings are answered by the WebSocket layer; anything else is ignored.
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return End::ClientGone,
                Some(Ok(_)) => {}
            },
            _ = ping.tick() => {
                if !matches!(
                    tokio::time::timeout(SEND_LIMIT, ws.send(Message::Ping(Default::default()))).await,
                    Ok(Ok(()))
                ) {
                    return End::ClientGone;
                }
            }
            change = changes.next() => {
                let (kind, change) = match change {
                    Some((kind, Ok(change))) => (kind, change),
                    Some((kind, Err(err))) => {
                        tracing::warn!(%err, "change stream: cannot read the {} bucket", kind.name());
                        return End::Close(
                            CloseCode::Error,
                            format!("read error; {}", resume(&cursor)),
                        );
                    }
                    None => {
                        return End::Close(CloseCode::Error, format!("read error; {}", resume(&cursor)));
                    }
                };
                let before = cursor;
                if let Change::Put { revision, .. } | Change::Removed { revision, .. } = &change {
                    if let Some(lost) = lost_events(kind, cursor.get(kind), *revision) {
                        return End::Close(CloseCode::Policy, lost);
                    }
                    cursor.set(kind, *revision);
                }
                let Some(text) = message(kind, &change, &cursor, &filter, &mut sent) else {
                    continue;
                };
                match tokio::time::timeout(SEND_LIMIT, ws.send(Message::text(text))).await {
                    Ok(Ok(())) => ping.reset(),
                    Ok(Err(_)) => return End::ClientGone,
                    Err(_) => {
                        return End::Close(
                            CloseCode::Policy,
                            format!("too far behind; {}", resume(&before)),
                        );
                    }
                }
            }
        }
    }
}

/// The event log is written once per key and loses records only by age and size, so a
/// jump in its revisions is records dropped before the stream sent them: said, not
/// skipped. (In the other buckets a jump is a value superseded by the one delivered.)
fn lost_events(kind: Kind, last: u64, revision: u64) -> Option<String> {
    (kind == Kind::Event && revision > last + 1).then(|| {
        format!(
            "event log dropped revisions {}..{} before they were sent; start again",
            last + 1,
            revision - 1
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_server_writes_a_client_reads_as_a_message() {
        let record = RawValue::from_string(r#"{"v":1}"#.into()).unwrap();
        for (record, removed) in [(Some(&*record), false), (None, true)] {
            let out = Out {
                kind: Kind::Request,
                key: "req-1",
                revision: 7,
                cursor: "1.7.0.0".into(),
                record,
                removed,
            };
            let read: ChangeMessage = serde_json::from_str(&serde_json::to_string(&out).unwrap())
                .expect("a stream message decodes as ChangeMessage");
            assert_eq!(
                (read.kind, read.revision, read.removed),
                (Kind::Request, 7, removed)
            );
            assert_eq!(read.record.is_some(), !removed);
        }
    }

    #[test]
    fn a_cursor_reads_back_what_it_writes() {
        let cursor = Cursor([1, 20, 300, 4000]);
        assert_eq!(cursor.to_string(), "1.20.300.4000");
        assert_eq!("1.20.300.4000".parse::<Cursor>(), Ok(cursor));
        for bad in ["", "1.2.3", "1.2.3.4.5", "a.b.c.d", "-1.2.3.4"] {
            assert!(bad.parse::<Cursor>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_query_names_what_is_wrong() {
        assert_eq!(parse_query(None).unwrap().start, Start::Now);
        assert_eq!(
            parse_query(Some("from=start")).unwrap().start,
            Start::Oldest
        );
        assert_eq!(
            parse_query(Some("after=1.2.3.4")).unwrap().start,
            Start::After(Cursor([1, 2, 3, 4]))
        );
        let refused = |q| parse_query(Some(q)).unwrap_err();
        assert!(refused("color=red").contains("accepted are after, from"));
        assert!(refused("after=x").contains("bad position"));
        assert!(refused("kind=event,slot").contains("unknown kind \"slot\""));
        assert!(refused("from=later").contains("bad from"));
        assert!(refused("after=1.2.3.4&from=start").contains("not both"));
        assert!(refused("label=a&label=b").contains("twice"));
        assert!(refused("request=a b").contains("bad request="));
    }

    #[test]
    fn filters_match_what_a_change_is_about() {
        let about = About {
            request: Some("r1".to_string()),
            nodes: vec!["n1".to_string()],
            backing: Some("b1".to_string()),
            labels: vec!["small".to_string()],
            client: None,
        };
        let filter = |q| parse_query(Some(q)).unwrap().filter;
        assert!(filter("").keeps(Kind::Node, &about));
        assert!(filter("kind=node,request&label=small").keeps(Kind::Node, &about));
        assert!(!filter("kind=event").keeps(Kind::Node, &about));
        assert!(!filter("label=large").keeps(Kind::Node, &about));
        assert!(!filter("kind=node&label=large").keeps(Kind::Node, &about));
        assert!(!filter("kind=node").keeps(Kind::Request, &About::default()));
    }

    #[test]
    fn a_client_streams_its_own_requests_and_nodes_and_their_removals_only() {
        let caller = Caller::Client(UserName::parse("ci").unwrap());
        let params = parse_query(None)
            .unwrap()
            .for_caller(caller.clone())
            .unwrap();
        let refused = parse_query(Some("kind=request,event"))
            .unwrap()
            .for_caller(caller.clone())
            .unwrap_err();
        assert!(refused.contains("kind=event"), "{refused}");
        let (cursor, filter, mut sent) = (Cursor::default(), params.filter, Sent::new());
        let request = |id: &str, client: &str| Change::Put {
            key: id.to_string(),
            revision: 1,
            value: serde_json::to_vec(&serde_json::json!({
                "v": 1, "id": id, "labels": ["l"], "requestor": "x", "priority": 0,
                "created_at": 0, "state": "requested", "status": "", "updated_at": 0,
                "client": client,
                "ssh_public_key": "ssh-ed25519 AAAA secret-of-someone"
            }))
            .unwrap()
            .into(),
        };
        let removed = |id: &str| Change::Removed {
            key: id.to_string(),
            revision: 2,
        };
        let mut out = |c: &Change, kind| message(kind, c, &cursor, &filter, &mut sent).is_some();
        assert!(out(&request("req-mine", "ci"), Kind::Request));
        assert!(!out(&request("req-theirs", "other"), Kind::Request));
        assert!(!out(&removed("req-theirs"), Kind::Request));
        assert!(out(&removed("req-mine"), Kind::Request));
        // Once removed, a second removal of the key is no longer the client's.
        assert!(!out(&removed("req-mine"), Kind::Request));
        // Events and backing nodes are not a client's.
        assert!(!out(&removed("bn-1"), Kind::Backing));
    }

    #[test]
    fn only_a_jump_in_the_event_log_is_a_loss() {
        assert_eq!(lost_events(Kind::Event, 4, 5), None);
        assert!(lost_events(Kind::Event, 4, 9).is_some_and(|why| why.contains("5..8")));
        assert_eq!(lost_events(Kind::Request, 4, 9), None);
    }

    #[test]
    fn a_removed_slot_is_about_its_backing_node() {
        let backing = BackingId::generate();
        let key = slotpool_protocol::layout::slot_key(&backing, 3);
        let about = About::of(Kind::Node, &key, None);
        assert_eq!(about.backing, Some(backing.to_string()));
        assert!(about.nodes.is_empty() && about.request.is_none());
    }
}
