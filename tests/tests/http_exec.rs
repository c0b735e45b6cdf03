//! The execute channel over `slotpool serve --http` (docs/http.md, "Running commands"):
//! the exec WebSocket with a real WebSocket client (tokio-tungstenite) and the file
//! routes with curl, against a real nats-server with credentials, a real launcher and
//! real agents in users mode. Authorised per bus user: a client's token runs in its own
//! nodes only.

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use slotpool_protocol::auth::Role;
use slotpool_protocol::client::{submission, Client};
use slotpool_protocol::model::Node;
use slotpool_tests::{label, wait_for, IsolationEnv, Pool};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const WAIT: Duration = Duration::from_secs(60);

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

async fn users_pool_with_http(env: &IsolationEnv) -> (Pool, SocketAddr) {
    let args = env.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let pool = Pool::start_serving_with(
        1,
        5,
        &label("small", 2, 60, &[]),
        1,
        &args,
        &["--http", "127.0.0.1:0"],
    )
    .await;
    let addr = pool.http_addr(0).await;
    (pool, addr)
}

async fn held_node(pool: &Pool, client: &str) -> Node {
    let client = Client::connect(&pool.nats.options_as(Role::Client, client))
        .await
        .unwrap();
    let done = client
        .submit_and_wait(&submission(vec!["small".into()], "test"))
        .await
        .expect("a node");
    client.nodes(&done.nodes).await.unwrap().remove(0)
}

/// Opens the exec WebSocket of `node`: the socket, or the HTTP status it was refused with.
async fn open(addr: SocketAddr, node: &str, token: &str) -> Result<Ws, u16> {
    let mut request = format!("ws://{addr}/api/v1/nodes/{node}/exec")
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    match tokio_tungstenite::client_async(request, tcp).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(res)) => Err(res.status().as_u16()),
        Err(e) => panic!("handshake: {e}"),
    }
}

/// What a run gave: stdout, stderr, and the last event (`exit` or `error`).
#[derive(Debug, Default)]
struct Run {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    events: Vec<Value>,
}

/// Reads `ws` to its end.
async fn collect(ws: &mut Ws) -> Run {
    let mut run = Run::default();
    loop {
        let msg = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("a message in time");
        match msg {
            Some(Ok(Message::Binary(b))) => match b.first() {
                Some(1) => run.stdout.extend_from_slice(&b[1..]),
                Some(2) => run.stderr.extend_from_slice(&b[1..]),
                other => panic!("a frame tagged {other:?}"),
            },
            Some(Ok(Message::Text(t))) => run.events.push(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Close(_))) | None => return run,
            Some(Ok(_)) => {}
            Some(Err(e)) => panic!("the socket broke: {e}"),
        }
    }
}

/// Runs `start` (the command, as JSON) with `stdin` and reads it to the end.
async fn run(addr: SocketAddr, node: &str, token: &str, start: Value, stdin: &[u8]) -> Run {
    let mut ws = open(addr, node, token).await.expect("the handshake");
    ws.send(Message::text(start.to_string())).await.unwrap();
    for chunk in stdin.chunks(60_000) {
        ws.send(Message::binary(chunk.to_vec())).await.unwrap();
    }
    ws.send(Message::binary(Vec::new())).await.unwrap();
    collect(&mut ws).await
}

fn exit_of(run: &Run) -> &Value {
    let last = run.events.last().expect("an event");
    &last["exit"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_runs_commands_and_moves_files_in_its_node_over_http() {
    let env = IsolationEnv::new();
    let (pool, addr) = users_pool_with_http(&env).await;
    let node = held_node(&pool, "ci").await;
    let id = node.id.to_string();
    let token = pool.nats.http_token(Role::Client, "ci");
    let user = node.login.username.clone().unwrap();

    // As the slot's user, in its workspace; stdin in (more than the agent's stdin
    // window), stdout and stderr apart, the status.
    let all: Vec<u8> = (0..=255u8).cycle().take(256 * 4000).collect();
    let r = run(
        addr,
        &id,
        &token,
        json!({"argv": ["sh", "-c", "cat; id -un >&2; pwd >&2; exit 3"]}),
        &all,
    )
    .await;
    assert_eq!(
        r.events[0]["started"]["session"].as_str().map(str::len),
        Some(26)
    );
    assert!(r.stdout == all, "stdout: {} bytes", r.stdout.len());
    let workspace = node.workspace.clone().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&r.stderr),
        format!("{user}\n{workspace}\n")
    );
    assert_eq!(exit_of(&r)["code"], 3, "{:?}", r.events);

    // The environment, a time limit and a signal.
    let r = run(
        addr,
        &id,
        &token,
        json!({"argv": ["sh", "-c", "printf %s \"$A\""], "env": {"A": "b c"}}),
        b"",
    )
    .await;
    assert_eq!(
        (r.stdout.as_slice(), &exit_of(&r)["code"]),
        (&b"b c"[..], &json!(0))
    );
    let r = run(
        addr,
        &id,
        &token,
        json!({"argv": ["sleep", "60"], "timeout_secs": 1}),
        b"",
    )
    .await;
    assert_eq!(exit_of(&r)["timed_out"], true, "{:?}", r.events);
    let mut ws = open(addr, &id, &token).await.unwrap();
    ws.send(Message::text(
        json!({"argv": ["sh", "-c", "echo up; exec sleep 60"]}).to_string(),
    ))
    .await
    .unwrap();
    loop {
        match ws.next().await.unwrap().unwrap() {
            Message::Binary(b) if b.as_ref() == b"\x01up\n" => break,
            _ => {}
        }
    }
    ws.send(Message::text(r#"{"signal":"TERM"}"#))
        .await
        .unwrap();
    let r = collect(&mut ws).await;
    assert_eq!(exit_of(&r)["signal"], 15, "{:?}", r.events);

    // A bad command is refused with a clear error.
    let r = run(addr, &id, &token, json!({"argv": []}), b"").await;
    let error = r.events.last().unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(error.contains("argv is empty"), "{error}");

    // Files: put in (directories made), read back byte for byte, as the slot's user.
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("in.bin");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&local, &data).unwrap();
    let url = |path: &str| format!("http://{addr}/api/v1/nodes/{id}/file?path={path}");
    let (status, _) = curl(
        &token,
        &["-T", local.to_str().unwrap(), &url("sub/dir/in.bin")],
    );
    assert_eq!(status, 204, "{}", pool.logs());
    let got = dir.path().join("out.bin");
    let (status, _) = curl(
        &token,
        &["-o", got.to_str().unwrap(), &url("sub/dir/in.bin")],
    );
    assert_eq!(status, 200);
    assert!(
        std::fs::read(&got).unwrap() == data,
        "the file came back changed"
    );
    let r = run(
        addr,
        &id,
        &token,
        json!({"argv": ["stat", "-c", "%U %s", "sub/dir/in.bin"]}),
        b"",
    )
    .await;
    assert_eq!(
        String::from_utf8_lossy(&r.stdout),
        format!("{user} 3000000\n")
    );
    let (status, body) = curl(&token, &[&url("no/such/file")]);
    assert_eq!(status, 404);
    assert!(
        body.contains("reading no/such/file") && body.contains("No such file"),
        "{body}"
    );
    let (status, body) = curl(&token, &["-T", local.to_str().unwrap(), &url("sub")]);
    assert_eq!(status, 409, "{body}");
    let (status, _) = curl(
        &token,
        &[
            "-X",
            "PUT",
            &format!("http://{addr}/api/v1/nodes/{id}/file"),
        ],
    );
    assert_eq!(status, 400);

    // Who may: another client's token, an operator's, none.
    let other = pool.nats.http_token(Role::Client, "other");
    assert_eq!(open(addr, &id, &other).await.err(), Some(403));
    let (status, body) = curl(&other, &[&url("sub/dir/in.bin")]);
    assert_eq!(status, 403);
    assert!(body.contains("belongs to another client"), "{body}");
    assert_eq!(
        open(addr, "node-bn-nothere-s0", &token).await.err(),
        Some(404)
    );
    let operator = pool.operator_token();
    assert_eq!(open(addr, &id, &operator).await.err(), Some(403));
    assert_eq!(open(addr, &id, "nonsense").await.err(), Some(401));
    assert_eq!(curl("nonsense", &[&url("sub/dir/in.bin")]).0, 401);

    // A client that leaves mid-command leaves nothing running.
    let mut ws = open(addr, &id, &token).await.unwrap();
    ws.send(Message::text(
        json!({"argv": ["sh", "-c", "echo up; exec sleep 600"]}).to_string(),
    ))
    .await
    .unwrap();
    loop {
        if let Message::Binary(_) = ws.next().await.unwrap().unwrap() {
            break;
        }
    }
    drop(ws);
    let users = env.users();
    wait_for("the command of a client that left is killed", WAIT, || {
        let left = Command::new("pgrep")
            .args(["-u", &users.join(","), "-x", "sleep"])
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success();
        async move { !left }
    })
    .await;
}

/// Exec sockets, like change streams, are never closed to make room: together they may
/// fill half the listener, and the next is refused with 503 until one ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_sockets_and_streams_share_half_the_listener() {
    let env = IsolationEnv::new();
    let args = env.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let pool = Pool::start_serving_with(
        1,
        5,
        &label("small", 2, 60, &[]),
        1,
        &args,
        &["--http", "127.0.0.1:0", "--http-max-connections", "4"],
    )
    .await;
    let addr = pool.http_addr(0).await;
    let node = held_node(&pool, "ci").await;
    let id = node.id.to_string();
    let token = pool.nats.http_token(Role::Client, "ci");
    let sleeper = || Message::text(json!({"argv": ["sh", "-c", "exec sleep 600"]}).to_string());
    let mut first = open(addr, &id, &token).await.expect("the first socket");
    first.send(sleeper()).await.unwrap();
    let mut second = open(addr, &id, &token).await.expect("the second socket");
    second.send(sleeper()).await.unwrap();
    assert_eq!(open(addr, &id, &token).await.err(), Some(503));
    let mut stream = format!("ws://{addr}/api/v1/stream")
        .into_client_request()
        .unwrap();
    stream
        .headers_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    match tokio_tungstenite::client_async(stream, tcp).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(res)) => {
            assert_eq!(res.status().as_u16(), 503)
        }
        other => panic!("a change stream past the limit: {other:?}"),
    }
    // One ends: its place is free again.
    first.close(None).await.unwrap();
    drop(first);
    let mut third = slotpool_tests::wait_for_some("a place for the third socket", WAIT, || {
        let token = token.clone();
        let id = id.clone();
        async move { open(addr, &id, &token).await.ok() }
    })
    .await;
    third.send(sleeper()).await.unwrap();
    drop((second, third));
}

/// A download its reader stopped taking, an upload that stopped coming and an exec
/// socket do not hold the launcher at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_transfers_do_not_hold_the_launcher_at_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = IsolationEnv::new();
    let (mut pool, addr) = users_pool_with_http(&env).await;
    let node = held_node(&pool, "ci").await;
    let id = node.id.to_string();
    let token = pool.nats.http_token(Role::Client, "ci");
    let r = run(
        addr,
        &id,
        &token,
        json!({"argv": ["sh", "-c", "head -c 100000000 /dev/zero > big"]}),
        b"",
    )
    .await;
    assert_eq!(exit_of(&r)["code"], 0);
    // A GET whose body nobody reads past its first bytes.
    let mut download = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "GET /api/v1/nodes/{id}/file?path=big HTTP/1.1\r\nHost: {addr}\r\n\
         Authorization: Bearer {token}\r\n\r\n"
    );
    download.write_all(head.as_bytes()).await.unwrap();
    let mut first = [0u8; 12];
    download.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    // A PUT that promises more than it sends.
    let mut upload = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "PUT /api/v1/nodes/{id}/file?path=partial HTTP/1.1\r\nHost: {addr}\r\n\
         Authorization: Bearer {token}\r\nContent-Length: 1000000\r\n\r\npartial"
    );
    upload.write_all(head.as_bytes()).await.unwrap();
    // An exec socket with a command running.
    let mut ws = open(addr, &id, &token).await.unwrap();
    ws.send(Message::text(json!({"argv": ["sleep", "600"]}).to_string()))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let status = pool.stop_launcher(0, WAIT).await;
    assert!(
        status.success(),
        "the launcher did not stop cleanly: {status:?}"
    );
    println!("the launcher stopped in {:?}", started.elapsed());
    drop((download, upload, ws));
}

/// The pid of the pool's only agent.
fn agent_pid(pool: &Pool) -> i32 {
    let dir = pool.work_dir().display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .find_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<i32>().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            (cmdline.contains("slotpool-agent") && cmdline.contains(&dir)).then_some(pid)
        })
        .expect("the agent's process")
}

/// A node lost under a running command, its agent unable to say so (stopped): the
/// socket says so at once and closes with 1011.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lost_under_an_http_command_ends_its_socket() {
    let env = IsolationEnv::new();
    let (pool, addr) = users_pool_with_http(&env).await;
    let node = held_node(&pool, "ci").await;
    let token = pool.nats.http_token(Role::Client, "ci");
    let mut ws = open(addr, &node.id.to_string(), &token).await.unwrap();
    ws.send(Message::text(
        json!({"argv": ["sh", "-c", "echo up; exec sleep 600"]}).to_string(),
    ))
    .await
    .unwrap();
    loop {
        if let Message::Binary(_) = ws.next().await.unwrap().unwrap() {
            break;
        }
    }
    let agent = rustix::process::Pid::from_raw(agent_pid(&pool)).unwrap();
    rustix::process::kill_process(agent, rustix::process::Signal::STOP).unwrap();
    let operator = Client::connect(&pool.nats.options_as(Role::Operator, "ops"))
        .await
        .unwrap();
    let _ = operator
        .release_node(node.id.clone(), Some("taken away".into()))
        .await;
    let mut last = None;
    let close = loop {
        match tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("in time")
        {
            Some(Ok(Message::Text(t))) => last = Some(serde_json::from_str::<Value>(&t).unwrap()),
            Some(Ok(Message::Close(frame))) => break frame,
            Some(Ok(_)) => {}
            other => panic!("{other:?}"),
        }
    };
    rustix::process::kill_process(agent, rustix::process::Signal::CONT).unwrap();
    let last = last.expect("an event");
    assert_eq!(last["error"]["code"], "ended", "{last}");
    assert_eq!(close.map(|f| u16::from(f.code)), Some(1011));
}

/// Runs curl with `token` and `args`: the HTTP status and the body (unless `-o`).
fn curl(token: &str, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "-w", "\n%{http_code}", "-H"])
        .arg(format!("Authorization: Bearer {token}"))
        .args(args)
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, status) = text.rsplit_once('\n').expect("curl's status line");
    (status.trim().parse().expect("a status"), body.to_string())
}
