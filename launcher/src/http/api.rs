//! The read-only JSON API: `/api/v1/backing`, `/api/v1/nodes`,
//! `/api/v1/requests?label=L&state=S` and `/api/v1/events`, each a JSON array of the
//! same records KV holds (docs/protocol.md), in key order. All but the events come from
//! this launcher's mirror; the event log is not mirrored and is read from KV per call.
//! A client ([`Caller::Client`]) gets its own requests and nodes only, as on the bus, and
//! neither the backing nodes nor the event log.

use super::auth::Caller;
use crate::shared::Shared;
use serde::Serialize;
use slotpool_protocol::model::{Event, RequestState};
use slotpool_protocol::store::Versioned;
use std::collections::BTreeMap;

/// What a route answers: a JSON body, or a refusal a client can act on.
pub enum Answer {
    Json(Vec<u8>),
    BadRequest(String),
    Forbidden(String),
    NotFound,
    Unavailable(String),
}

/// Answers `path` (under `/api/v1/`) with `query` (the part after `?`, if any).
pub async fn answer(shared: &Shared, caller: &Caller, path: &str, query: Option<&str>) -> Answer {
    let query: BTreeMap<String, String> = query
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default();
    let operators_only = |what: &str| {
        Answer::Forbidden(format!(
            "{what} are for operators; a client reads its own requests and nodes"
        ))
    };
    match path {
        "backing" if *caller != Caller::Everything => operators_only("the backing nodes"),
        "events" if *caller != Caller::Everything => operators_only("the event log's records"),
        "backing" => json(&sorted(&shared.world().backing)),
        "nodes" => {
            let world = shared.world();
            let mut nodes: Vec<_> = world
                .slots
                .iter()
                .filter(|(_, n)| caller.sees(n.value.client.as_ref()))
                .collect();
            nodes.sort_by(|a, b| a.0.cmp(b.0));
            json(&nodes.iter().map(|(_, n)| &n.value).collect::<Vec<_>>())
        }
        "requests" => {
            let state = match query.get("state").map(|s| parse_state(s)).transpose() {
                Ok(state) => state,
                Err(why) => return Answer::BadRequest(why),
            };
            let label = query.get("label");
            let world = shared.world();
            let mut requests: Vec<_> = world
                .requests
                .values()
                .filter(|r| caller.sees(r.value.client.as_ref()))
                .filter(|r| state.is_none_or(|s| r.value.state == s))
                .filter(|r| label.is_none_or(|l| r.value.labels.contains(l)))
                .collect();
            requests.sort_by(|a, b| a.key.cmp(&b.key));
            json(&requests.iter().map(|r| &r.value).collect::<Vec<_>>())
        }
        "events" => match shared.bus.events.list::<Event>().await {
            Ok(list) => {
                let mut events: Vec<Event> = list
                    .into_iter()
                    .filter_map(Result::ok)
                    .map(|v| v.value)
                    .collect();
                events.sort_by(|a, b| a.id.cmp(&b.id));
                json(&events)
            }
            Err(err) => Answer::Unavailable(format!("reading the event log: {err}")),
        },
        _ => Answer::NotFound,
    }
}

fn sorted<T>(records: &std::collections::HashMap<String, Versioned<T>>) -> Vec<&T> {
    let mut keyed: Vec<_> = records.iter().collect();
    keyed.sort_by(|a, b| a.0.cmp(b.0));
    keyed.into_iter().map(|(_, v)| &v.value).collect()
}

fn parse_state(s: &str) -> Result<RequestState, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|_| {
        format!(
            "unknown request state {s:?}: one of requested, fulfilled, failed, canceled, reclaimed"
        )
    })
}

fn json<T: Serialize + ?Sized>(value: &T) -> Answer {
    match serde_json::to_vec(value) {
        Ok(body) => Answer::Json(body),
        Err(err) => Answer::Unavailable(format!("encoding: {err}")),
    }
}
