//! `slotpool serve --http`: `/metrics` read back with a Prometheus text-format parser and
//! checked against KV, the JSON API against KV, the readiness probe through a NATS
//! outage, and the refusal of an exposed listener without a token; the change stream
//! followed with a WebSocket client through a burst of requests, across a reconnect, and
//! through its filters and refusals.

use slotpool_protocol::model::{
    BackingNode, BackingState, Event, Node, NodeRequest, NodeState, RequestState,
};
use slotpool_tests::metrics::{get, scrape_as, value};
use slotpool_tests::{label, wait_for, wait_for_some, NatsServer, Pool, AGENT_ARGS};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(30);

/// A pool of one launcher serving HTTP on an ephemeral loopback port, and that port.
async fn pool_with_http(extra: &[&str]) -> (Pool, SocketAddr) {
    pool_with_http_grace(60, extra).await
}

/// [`pool_with_http`] with the label's grace-time.
async fn pool_with_http_grace(grace: u32, extra: &[&str]) -> (Pool, SocketAddr) {
    pool_with_http_slots(2, grace, extra).await
}

/// [`pool_with_http`] with `slots` slots per backing node and the label's grace-time.
async fn pool_with_http_slots(slots: u32, grace: u32, extra: &[&str]) -> (Pool, SocketAddr) {
    let mut args = vec!["--http", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let labels = label("small", slots, grace, &[]);
    let pool = Pool::start_serving_with(2, 5, &labels, 1, &AGENT_ARGS, &args).await;
    let addr = pool.http_addr(0).await;
    (pool, addr)
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_agree_with_kv_once_a_request_is_fulfilled() {
    let (pool, addr) = pool_with_http(&[]).await;
    let op = pool.operator_token();
    let before = scrape_as(addr, Some(&op)).await;
    assert_eq!(value(&before, "slotpool_allocation_seconds", &[]), 0.0);
    assert_eq!(
        value(
            &before,
            "slotpool_slots",
            &[("label", "small"), ("state", "used")]
        ),
        0.0
    );

    let id = pool.submit(&["small"]).await;
    pool.fulfilled(&id).await;
    // KV: one node of the request ready, one backing node ready.
    let nodes = pool.nodes().await;
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert_eq!(nodes[0].state, NodeState::Ready);
    let ready = pool.backing_in(&[BackingState::Ready]).await;
    assert_eq!(ready.len(), 1);
    let b = &ready[0];

    // The gauges come from the mirror, which follows KV: wait until it has caught up.
    let s = wait_for_some("/metrics to show the fulfilled request", WAIT, || async {
        let s = scrape_as(addr, Some(&op)).await;
        let used = value(
            &s,
            "slotpool_slots",
            &[("label", "small"), ("state", "used")],
        );
        (used == 1.0).then_some(s)
    })
    .await;
    let backing = [
        ("provider", b.provider.as_str()),
        ("pool", b.pool.as_str()),
        ("label", "small"),
        ("state", "ready"),
    ];
    assert_eq!(value(&s, "slotpool_backing_nodes", &backing), 1.0);
    assert_eq!(value(&s, "slotpool_backing_nodes", &[]), 1.0);
    assert_eq!(
        value(
            &s,
            "slotpool_slots",
            &[("label", "small"), ("state", "free")]
        ),
        f64::from(b.slots - 1)
    );
    assert_eq!(
        value(&s, "slotpool_requests_waiting", &[("label", "small")]),
        0.0
    );
    assert_eq!(value(&s, "slotpool_allocation_seconds", &[]), 1.0);
    let place = &backing[..3];
    assert_eq!(
        value(
            &s,
            "slotpool_launches_total",
            &[place, &[("outcome", "launched")]].concat()
        ),
        1.0
    );
    // The backing node booted once: launch to its agent's first heartbeat.
    assert_eq!(value(&s, "slotpool_boot_seconds", &[]), 1.0);
    // Its agent heartbeats: none missing, and the oldest heartbeat's age is there.
    assert_eq!(value(&s, "slotpool_agent_heartbeats_missing", place), 0.0);
    assert_eq!(
        slotpool_tests::metrics::samples(&s, "slotpool_agent_heartbeat_age_max_seconds", place)
            .len(),
        1
    );
    assert_eq!(value(&s, "slotpool_capacity_backoff_seats", &[]), 0.0);
    assert_eq!(value(&s, "slotpool_provider_errors_total", &[]), 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_is_503_while_nats_is_down_and_200_once_back() {
    let (mut pool, addr) = pool_with_http(&[]).await;
    assert_eq!(get(addr, "/healthz", None).await.0, 200);
    wait_for("/readyz 200 once synced", WAIT, || async {
        get(addr, "/readyz", None).await.0 == 200
    })
    .await;
    pool.nats.stop().await;
    wait_for("/readyz 503 while NATS is down", WAIT, || async {
        get(addr, "/readyz", None).await.0 == 503
    })
    .await;
    assert_eq!(get(addr, "/healthz", None).await.0, 200, "still up");
    pool.nats.resume().await;
    wait_for("/readyz 200 again once NATS is back", WAIT, || async {
        get(addr, "/readyz", None).await.0 == 200
    })
    .await;
}

/// `--http-no-auth` is for loopback only: on any other address `slotpool serve` refuses
/// to start, saying why.
#[tokio::test(flavor = "multi_thread")]
async fn an_exposed_listener_is_never_open() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("pool.yaml");
    std::fs::write(
        &config,
        slotpool_tests::config_yaml(
            &dir.path().join("agents"),
            1,
            5,
            &label("small", 1, 60, &[]),
        ),
    )
    .expect("config");
    let mut args = nats.serve_args(&config);
    args.extend(["--http".into(), "0.0.0.0:0".into(), "--http-no-auth".into()]);
    let out = tokio::process::Command::new(slotpool_tests::bin_path("slotpool"))
        .args(&args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(WAIT, out)
        .await
        .expect("slotpool serve refuses at once")
        .expect("running slotpool serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it must not start: {stderr}");
    assert!(
        stderr.contains("refusing --http-no-auth") && stderr.contains("not a loopback address"),
        "the error says why and what to do: {stderr}"
    );
}

/// Each client reads its own requests and nodes over HTTP, and streams only them, as on
/// the bus: never another client's records (and with them its SSH key); operators read
/// everything; callers without a token, or with an agent's, are refused.
#[tokio::test(flavor = "multi_thread")]
async fn each_client_sees_only_its_own_requests_and_nodes() {
    use slotpool_protocol::auth::Role;
    use slotpool_protocol::client::{submission, Client};
    let (pool, addr) = pool_with_http_slots(4, 60, &[]).await;
    let op = pool.operator_token();
    let ci_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl ci@victim";
    let mut ids = std::collections::BTreeMap::new();
    for (name, key) in [("ci", Some(ci_key)), ("mallory", None)] {
        let client = Client::connect(&pool.nats.options_as(Role::Client, name))
            .await
            .expect("a client connects");
        let mut sub = submission(vec!["small".into()], name);
        sub.ssh_public_key = key.map(str::to_string);
        let id = client.submit(&sub).await.expect("submit");
        let request = client.wait(&id, |_| {}).await.expect("fulfilled");
        ids.insert(name, (id, request.nodes));
    }
    let mallory = pool.nats.http_token(Role::Client, "mallory");
    wait_for("the operator to read both requests", WAIT, || async {
        get_json::<Vec<NodeRequest>>(addr, "/api/v1/requests", &op)
            .await
            .len()
            == 2
    })
    .await;
    let theirs: Vec<NodeRequest> = get_json(addr, "/api/v1/requests", &mallory).await;
    assert_eq!(theirs.len(), 1, "{theirs:?}");
    assert_eq!(theirs[0].id, ids["mallory"].0);
    let nodes: Vec<Node> = get_json(addr, "/api/v1/nodes", &mallory).await;
    assert_eq!(
        nodes.iter().map(|n| n.id.clone()).collect::<Vec<_>>(),
        ids["mallory"].1
    );
    let all: Vec<Node> = get_json(addr, "/api/v1/nodes", &op).await;
    assert_eq!(all.len(), 2);
    for path in ["/api/v1/backing", "/api/v1/events", "/metrics"] {
        let (status, body) = get(addr, path, Some(&mallory)).await;
        assert_eq!(status, 403, "{path}: {body}");
    }
    for path in ["/api/v1/requests", "/api/v1/nodes", "/metrics"] {
        assert_eq!(get(addr, path, None).await.0, 401, "{path}");
    }
    let agent = pool.nats.http_token(Role::Agent, "bn-other");
    assert_eq!(get(addr, "/api/v1/requests", Some(&agent)).await.0, 403);
    // The change stream from the start: the client's own request and node, and nothing
    // of ci's, whose SSH key its request carries.
    assert_eq!(refused(addr, "kind=event", Some(&mallory)).await.0, 403);
    let mut ws = stream(addr, "from=start", Some(&mallory))
        .await
        .expect("the stream opens");
    let mut seen = Vec::new();
    let (mine, my_node) = (
        ids["mallory"].0.to_string(),
        ids["mallory"].1[0].to_string(),
    );
    follow_until(&mut ws, &mut seen, |seen| {
        fulfilled_in(seen).contains(&mine)
            && seen
                .iter()
                .any(|m| m["kind"] == "node" && m["record"]["id"] == my_node.as_str())
    })
    .await;
    for m in &seen {
        let text = m.to_string();
        assert!(
            !text.contains("ci@victim") && !text.contains(ids["ci"].0.as_str()),
            "{m}"
        );
        assert_eq!(m["record"]["client"], "mallory", "{m}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_guards_metrics_but_not_the_probes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").expect("token file");
    let (_pool, addr) =
        pool_with_http(&["--http-token-file", token_file.to_str().expect("utf-8")]).await;
    assert_eq!(get(addr, "/metrics", None).await.0, 401);
    assert_eq!(get(addr, "/metrics", Some("wrong")).await.0, 401);
    assert_eq!(get(addr, "/api/v1/backing", None).await.0, 401);
    assert_eq!(get(addr, "/api/v1/backing", Some("s3cret")).await.0, 200);
    let (status, body) = get(addr, "/metrics", Some("s3cret")).await;
    assert_eq!(status, 200);
    assert!(body.contains("slotpool_backing_nodes"), "{body}");
    assert_eq!(get(addr, "/healthz", None).await.0, 200);
}

/// GETs `path` with `token` and parses the body as JSON of type `T`.
async fn get_json<T: serde::de::DeserializeOwned>(addr: SocketAddr, path: &str, token: &str) -> T {
    let (status, body) = get(addr, path, Some(token)).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|err| panic!("{path}: {err}: {body}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_json_api_serves_the_records_kv_holds() {
    let (pool, addr) = pool_with_http(&[]).await;
    let op = pool.operator_token();
    let held = pool.submit(&["small"]).await;
    pool.fulfilled(&held).await;

    let kv_backing = pool.client.list_backing().await.expect("list backing");
    let kv_nodes = pool.nodes().await;
    // The mirror holds the requests that are open or hold nodes; finished ones stay in
    // KV only.
    let kv_requests: Vec<NodeRequest> = pool
        .client
        .list_requests()
        .await
        .expect("list requests")
        .into_iter()
        .filter(|r| !r.is_finished())
        .collect();
    let kv_events = pool.client.list_events().await.expect("list events");
    assert!(!kv_backing.is_empty() && !kv_nodes.is_empty() && !kv_events.is_empty());
    // The mirror follows KV: wait until it has caught up with what was read.
    wait_for("the API to serve what KV holds", WAIT, || async {
        get_json::<Vec<BackingNode>>(addr, "/api/v1/backing", &op).await == kv_backing
            && get_json::<Vec<Node>>(addr, "/api/v1/nodes", &op).await == kv_nodes
    })
    .await;
    let mut all: Vec<NodeRequest> = get_json(addr, "/api/v1/requests", &op).await;
    let mut kv_sorted = kv_requests.clone();
    kv_sorted.sort_by(|a, b| a.id.cmp(&b.id));
    all.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(all, kv_sorted);
    let fulfilled: Vec<NodeRequest> =
        get_json(addr, "/api/v1/requests?label=small&state=fulfilled", &op).await;
    let kv_fulfilled: Vec<&NodeRequest> = kv_requests
        .iter()
        .filter(|r| r.state == RequestState::Fulfilled && r.labels.contains(&"small".into()))
        .collect();
    assert_eq!(fulfilled.iter().collect::<Vec<_>>(), kv_fulfilled);
    assert_eq!(fulfilled.len(), 1);
    assert_eq!(fulfilled[0].id, held);
    let events: Vec<Event> = get_json(addr, "/api/v1/events", &op).await;
    assert_eq!(events[..kv_events.len()], kv_events[..]);
    let canceled: Vec<NodeRequest> = get_json(addr, "/api/v1/requests?state=canceled", &op).await;
    assert!(canceled.is_empty(), "{canceled:?}");
    let other: Vec<NodeRequest> = get_json(addr, "/api/v1/requests?label=large", &op).await;
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(
        get(addr, "/api/v1/requests?state=bogus", Some(&op)).await.0,
        400
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn finished_requests_leave_the_mirror_and_stay_readable_by_their_client() {
    let (pool, addr) = pool_with_http(&[]).await;
    let op = pool.operator_token();
    const SERVED: usize = 1000;
    let mut ids = Vec::with_capacity(SERVED);
    for _ in 0..SERVED {
        let id = pool.submit(&["small"]).await;
        let r = pool.fulfilled(&id).await;
        pool.client.release(r.nodes).await.expect("release");
        ids.push(id);
    }
    // Each release ends with a write marking the request's nodes released, after which
    // the launcher has nothing left to do with it.
    wait_for(
        "the launcher's mirror to hold no finished request",
        WAIT,
        || async {
            get_json::<Vec<NodeRequest>>(addr, "/api/v1/requests", &op)
                .await
                .is_empty()
        },
    )
    .await;
    // KV keeps every one for its TTL, and the client reads its own through the API.
    let kv = pool.client.list_requests().await.expect("list requests");
    let finished = kv
        .iter()
        .filter(|r| ids.contains(&r.id) && r.is_finished())
        .count();
    assert_eq!(finished, SERVED);
    for id in [&ids[0], &ids[SERVED - 1]] {
        let r = pool
            .client
            .request(id)
            .await
            .expect("status")
            .unwrap_or_else(|| panic!("request {id} unknown to its client"));
        assert_eq!(r.state, RequestState::Fulfilled, "{r:?}");
        assert!(r.nodes_released_at.is_some(), "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_open_connection_does_not_hold_the_launcher_at_shutdown() {
    let (mut pool, addr) = pool_with_http(&[]).await;
    // A keep-alive connection, idle after its first answer, as a scraper leaves it.
    let mut idle = tokio::net::TcpStream::connect(addr).await.expect("connect");
    idle.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut first = [0u8; 12];
    idle.read_exact(&mut first).await.expect("an answer");
    assert_eq!(&first, b"HTTP/1.1 200");
    let status = pool.stop_launcher(0, WAIT).await;
    assert!(
        status.success(),
        "the launcher did not stop cleanly: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backing_node_released_after_its_grace_time_is_counted() {
    let (pool, addr) = pool_with_http_grace(1, &[]).await;
    let op = pool.operator_token();
    let id = pool.submit(&["small"]).await;
    let r = pool.fulfilled(&id).await;
    pool.release_and_wait(&r.nodes).await;
    wait_for("the idle backing node to be released", WAIT, || async {
        pool.backing().await.is_empty()
    })
    .await;
    // The deletion is counted, and the launcher's mirror sees the record gone, just
    // after the record is deleted in KV: wait for the scrape that shows both.
    let s = wait_for_some("the deletion to be counted and mirrored", WAIT, || async {
        let s = scrape_as(addr, Some(&op)).await;
        (value(&s, "slotpool_backing_deletions_total", &[]) >= 1.0
            && value(&s, "slotpool_backing_nodes", &[]) == 0.0)
            .then_some(s)
    })
    .await;
    let deletions = |reason| {
        value(
            &s,
            "slotpool_backing_deletions_total",
            &[("reason", reason)],
        )
    };
    assert_eq!(deletions("grace"), 1.0);
    assert_eq!(value(&s, "slotpool_backing_deletions_total", &[]), 1.0);
    assert_eq!(value(&s, "slotpool_backing_nodes", &[]), 0.0);
    assert_eq!(
        value(
            &s,
            "slotpool_slots",
            &[("label", "small"), ("state", "used")]
        ),
        0.0
    );
}

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens `/api/v1/stream?query` with a WebSocket client.
async fn stream(
    addr: SocketAddr,
    query: &str,
    token: Option<&str>,
) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = format!("ws://{addr}/api/v1/stream?{query}")
        .into_client_request()
        .expect("a request");
    if let Some(token) = token {
        let value = format!("Bearer {token}").parse().expect("a header value");
        request.headers_mut().insert("authorization", value);
    }
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tokio_tungstenite::client_async(request, tcp)
        .await
        .map(|(ws, _)| ws)
}

/// The next change message of `ws`, as JSON.
async fn next_change(ws: &mut Ws) -> serde_json::Value {
    use futures::StreamExt;
    loop {
        let message = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("a change within the wait")
            .expect("the stream stays open")
            .expect("a message");
        if let tokio_tungstenite::tungstenite::Message::Text(text) = message {
            return serde_json::from_str(text.as_str()).expect("JSON");
        }
    }
}

/// The status of a WebSocket handshake refused with an HTTP answer, and its body.
async fn refused(addr: SocketAddr, query: &str, token: Option<&str>) -> (u16, String) {
    match stream(addr, query, token).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(res)) => (
            res.status().as_u16(),
            String::from_utf8_lossy(res.body().as_deref().unwrap_or_default()).to_string(),
        ),
        Ok(_) => panic!("?{query} was accepted"),
        Err(err) => panic!("?{query}: {err}"),
    }
}

/// Takes `ws`'s messages into `seen` until `done` says the messages so far are enough.
async fn follow_until(
    ws: &mut Ws,
    seen: &mut Vec<serde_json::Value>,
    mut done: impl FnMut(&[serde_json::Value]) -> bool,
) {
    while !done(seen) {
        seen.push(next_change(ws).await);
    }
}

/// The ids of the requests whose `fulfilled` record is among `messages`.
fn fulfilled_in(messages: &[serde_json::Value]) -> std::collections::BTreeSet<String> {
    messages
        .iter()
        .filter(|m| m["kind"] == "request" && m["record"]["state"] == "fulfilled")
        .map(|m| m["key"].as_str().expect("a key").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_follows_a_burst_across_a_reconnect_with_nothing_missed_or_repeated() {
    const BURST: usize = 50;
    let (pool, addr) = pool_with_http_slots(25, 60, &[]).await;
    let op = pool.operator_token();
    let mut ws = stream(addr, "", Some(&op)).await.expect("the stream opens");
    let ids: Vec<String> = futures::future::join_all((0..BURST).map(|_| pool.submit(&["small"])))
        .await
        .iter()
        .map(ToString::to_string)
        .collect();

    // Part of the burst, then a disconnect, then the rest from the last position.
    let mut first = Vec::new();
    follow_until(&mut ws, &mut first, |seen| {
        fulfilled_in(seen).len() >= BURST / 3
    })
    .await;
    drop(ws);
    let cursor = first.last().expect("messages")["cursor"]
        .as_str()
        .expect("a cursor")
        .to_string();
    let mut ws = stream(addr, &format!("after={cursor}"), Some(&op))
        .await
        .expect("the stream resumes");
    let mut second = Vec::new();
    let before = fulfilled_in(&first);
    follow_until(&mut ws, &mut second, |seen| {
        before.len() + fulfilled_in(seen).len() >= BURST
    })
    .await;

    let all: Vec<_> = first.iter().chain(&second).collect();
    let got = fulfilled_in(&first.iter().chain(&second).cloned().collect::<Vec<_>>());
    for id in &ids {
        assert!(got.contains(id), "request {id}'s fulfilment missing");
    }
    // Per bucket, revisions only go up: no change came twice, before or after the resume.
    let mut last = std::collections::BTreeMap::new();
    for m in &all {
        let kind = m["kind"].as_str().expect("a kind").to_string();
        let revision = m["revision"].as_u64().expect("a revision");
        let previous = last.insert(kind.clone(), revision).unwrap_or(0);
        assert!(
            revision > previous,
            "{kind} revision {revision} came after {previous}: {m}"
        );
    }
    let kinds: std::collections::BTreeSet<_> = all
        .iter()
        .map(|m| m["kind"].as_str().unwrap_or(""))
        .collect();
    assert!(kinds.contains("node") && kinds.contains("backing") && kinds.contains("event"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_filtered_by_request_carries_only_that_request() {
    let (pool, addr) = pool_with_http_slots(4, 60, &[]).await;
    let op = pool.operator_token();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = pool.submit(&["small"]).await;
        pool.fulfilled(&id).await;
        ids.push(id.to_string());
    }
    let mine = &ids[1];
    let mut ws = stream(addr, &format!("from=start&request={mine}"), Some(&op))
        .await
        .expect("the stream opens");
    let mut seen = Vec::new();
    follow_until(&mut ws, &mut seen, |seen| {
        fulfilled_in(seen).contains(mine) && seen.iter().any(|m| m["kind"] == "node")
    })
    .await;
    for m in &seen {
        let about = match m["kind"].as_str() {
            Some("request") => &m["key"],
            Some("node") => &m["record"]["request_id"],
            _ => panic!("a message about no request: {m}"),
        };
        assert_eq!(about.as_str(), Some(mine.as_str()), "{m}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_refuses_bad_queries_and_asks_for_the_token() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").expect("token file");
    let (_pool, addr) =
        pool_with_http(&["--http-token-file", token_file.to_str().expect("utf-8")]).await;
    assert_eq!(refused(addr, "", None).await.0, 401);
    assert_eq!(refused(addr, "", Some("wrong")).await.0, 401);
    for (query, says) in [
        ("after=yesterday", "bad position"),
        ("after=0.0.0.999999", "beyond the last one written"),
        ("kind=slot", "unknown kind"),
        (
            "colour=red",
            "accepted are after, from, request, node, backing, label, kind",
        ),
        ("from=start&after=0.0.0.0", "not both"),
    ] {
        let (status, body) = refused(addr, query, Some("s3cret")).await;
        assert_eq!(status, 400, "?{query}: {body}");
        assert!(body.contains(says), "?{query}: {body}");
    }
    let (status, body) = get(addr, "/api/v1/stream", Some("s3cret")).await;
    assert_eq!(status, 426, "a plain GET: {body}");
    stream(addr, "kind=event", Some("s3cret"))
        .await
        .expect("with the token the stream opens");
}

/// The event log drops records by age and size; a position older than what it still holds
/// is refused with 410, not answered with a silent gap.
#[tokio::test(flavor = "multi_thread")]
async fn a_position_older_than_the_event_log_holds_is_gone() {
    let (pool, addr) = pool_with_http(&[]).await;
    let op = pool.operator_token();
    let id = pool.submit(&["small"]).await;
    pool.fulfilled(&id).await;
    let bus = pool.nats.bus().await;
    wait_for("the launch to record two events or more", WAIT, || async {
        bus.events
            .held_revisions()
            .await
            .is_ok_and(|(_, last)| last >= 2)
    })
    .await;
    // What the server does when the log reaches its limits: the oldest records go.
    let purged = bus
        .call_raw(
            "$JS.API.STREAM.PURGE.KV_slotpool_events",
            r#"{"keep":1}"#.into(),
            WAIT,
        )
        .await
        .expect("purging the event log");
    assert!(
        String::from_utf8_lossy(&purged).contains(r#""success":true"#),
        "purge: {}",
        String::from_utf8_lossy(&purged)
    );
    let (first, _) = bus.events.held_revisions().await.expect("held revisions");
    let (status, body) = refused(addr, "after=0.0.0.0", Some(&op)).await;
    assert_eq!(status, 410, "{body}");
    assert!(
        body.contains(&format!("no longer holds revisions 1..{}", first - 1)),
        "{body}"
    );
    // From what it still holds, the stream opens.
    stream(addr, &format!("after={}.0.0.0", first - 1), Some(&op))
        .await
        .expect("a position the log still holds opens the stream");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_open_stream_is_closed_at_shutdown_with_the_position_to_resume_from() {
    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
    use tokio_tungstenite::tungstenite::Message;
    let (mut pool, addr) = pool_with_http(&[]).await;
    let op = pool.operator_token();
    let mut ws = stream(addr, "", Some(&op)).await.expect("the stream opens");
    let closed = tokio::spawn(async move {
        while let Some(message) = ws.next().await {
            if let Message::Close(frame) = message.expect("a clean close") {
                return frame;
            }
        }
        None
    });
    let status = pool.stop_launcher(0, WAIT).await;
    assert!(
        status.success(),
        "the launcher did not stop cleanly: {status:?}"
    );
    let frame = tokio::time::timeout(WAIT, closed)
        .await
        .expect("the stream ends")
        .expect("the reader")
        .expect("a close frame");
    assert_eq!(frame.code, CloseCode::Away);
    assert!(
        frame.reason.as_str().contains("resume with after="),
        "{}",
        frame.reason
    );
}
