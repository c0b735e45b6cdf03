//! `slotpool serve --http` with `--http-tls-cert`/`--http-tls-key` (HTTPS only) and
//! `--http-client-ca` (a client certificate from that CA on every connection), against
//! certificates minted here with the PKI `slotpool nats-setup` makes.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use slotpool_cli::pki::{self, Pki, PkiPlan};
use slotpool_tests::{label, wait_for_some, Pool, AGENT_ARGS};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::TlsConnector;

const WAIT: Duration = Duration::from_secs(30);
/// Longest wait for one request's answer (or its refusal).
const ANSWER: Duration = Duration::from_secs(10);

fn make_pki(dir: &Path) -> Pki {
    pki::write_pki(&PkiPlan {
        dir: dir.to_path_buf(),
        server_names: vec!["localhost".into()],
        clients: vec!["scraper".into()],
        validity_days: 1,
        overwrite: false,
    })
    .unwrap_or_else(|err| panic!("making a PKI in {}: {err}", dir.display()))
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// A pool of one launcher serving HTTPS on `listen` with `pki`'s server certificate and
/// `extra` arguments, and the loopback address to reach it on.
async fn pool_with_https(pki: &Pki, listen: &str, extra: &[&str]) -> (Pool, SocketAddr) {
    let mut args = vec![
        "--http",
        listen,
        "--http-tls-cert",
        path(&pki.server_cert),
        "--http-tls-key",
        path(&pki.server_key),
    ];
    args.extend_from_slice(extra);
    let labels = label("small", 2, 60, &[]);
    let pool = Pool::start_serving_with(2, 5, &labels, 1, &AGENT_ARGS, &args).await;
    let port: u16 = wait_for_some("the launcher to say where it serves HTTPS", WAIT, || {
        let log = pool.launcher_log(0);
        async move {
            log.lines()
                .find_map(|l| l.split("http listening on ").nth(1))
                .filter(|rest| rest.contains("(https)"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|a| a.parse::<SocketAddr>().ok())
                .map(|a| a.port())
        }
    })
    .await;
    (pool, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A TLS client trusting `pki`'s CA, showing the certificate of `client` if given.
fn connector(pki: &Pki, client: Option<&str>) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&pki.ca_cert).expect("the CA file") {
        roots
            .add(cert.expect("a CA certificate"))
            .expect("a usable CA");
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some(name) => {
            let files = pki.client(name).expect("a client of the PKI");
            let chain = CertificateDer::pem_file_iter(&files.cert)
                .expect("the client certificate file")
                .collect::<Result<Vec<_>, _>>()
                .expect("client certificates");
            let key = PrivateKeyDer::from_pem_file(&files.key).expect("the client key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("a client certificate and its key")
        }
    };
    TlsConnector::from(Arc::new(config))
}

/// One GET over `stream`: the status and body, or what went wrong.
async fn get_over<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    addr: SocketAddr,
    path: &str,
) -> Result<(u16, String), String> {
    let head = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(head.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP response: {response:?}"))?;
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no HTTP status: {head:?}"))?;
    Ok((status, body.to_string()))
}

/// One GET over HTTPS with `tls`.
async fn https_get(
    tls: &TlsConnector,
    addr: SocketAddr,
    path: &str,
) -> Result<(u16, String), String> {
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from("localhost").expect("a server name");
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        get_over(stream, addr, path).await
    };
    tokio::time::timeout(ANSWER, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {ANSWER:?}")))
}

/// One GET in plain HTTP.
async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        get_over(tcp, addr, path).await
    };
    tokio::time::timeout(ANSWER, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {ANSWER:?}")))
}

#[tokio::test(flavor = "multi_thread")]
async fn https_answers_clients_that_trust_the_ca_and_plain_http_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = make_pki(dir.path());
    let (_pool, addr) = pool_with_https(&pki, "127.0.0.1:0", &[]).await;
    let tls = connector(&pki, None);

    let (status, body) = https_get(&tls, addr, "/healthz").await.expect("https");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    // Without a token or a client certificate, the routes past the probes ask for one.
    let (status, body) = https_get(&tls, addr, "/metrics").await.expect("https");
    assert_eq!(status, 401, "{body}");

    let plain = http_get(addr, "/healthz").await;
    assert!(
        plain.is_err(),
        "plain HTTP to the HTTPS port must get no answer, got {plain:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_ca_admits_only_clients_with_its_certificates_even_exposed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = make_pki(dir.path());
    // Every address, with no token: allowed, since every client must show a certificate.
    let (_pool, addr) =
        pool_with_https(&pki, "0.0.0.0:0", &["--http-client-ca", path(&pki.ca_cert)]).await;

    let anonymous = https_get(&connector(&pki, None), addr, "/healthz").await;
    assert!(
        anonymous.is_err(),
        "a client without a certificate must be refused, got {anonymous:?}"
    );

    let scraper = connector(&pki, Some("scraper"));
    let (status, body) = https_get(&scraper, addr, "/metrics")
        .await
        .expect("a client with a certificate from the CA");
    assert_eq!(status, 200, "no token needed with a certificate: {body}");
    assert!(body.contains("slotpool_"), "{body}");
}
