//! TLS between slotpool and nats-server with the PKI that `slotpool nats-setup` makes
//! (`slotpool_cli::pki`): a real nats-server with JetStream that requires a
//! client certificate from that CA.

use slotpool_cli::pki::{self, Pki, PkiPlan};
use slotpool_protocol::auth::Role;
use slotpool_protocol::connect::{Bus, BusError, NatsOptions};
use slotpool_tests::NatsServer;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// A refused connection must be reported well within this (the client's own connect
/// timeout is 5 s).
const REFUSAL: Duration = Duration::from_secs(20);

fn make_pki(dir: &Path) -> Pki {
    pki::write_pki(&PkiPlan {
        dir: dir.to_path_buf(),
        server_names: vec!["localhost".into(), "127.0.0.1".into()],
        clients: vec!["launcher".into(), "agent".into(), "operator".into()],
        validity_days: 1,
        overwrite: false,
    })
    .unwrap_or_else(|err| panic!("making a PKI in {}: {err}", dir.display()))
}

/// Options for the client `name` of `pki`, trusting `pki`'s CA.
fn client(pki: &Pki, name: &str) -> NatsOptions {
    let files = pki.client(name).expect("a client of the PKI");
    NatsOptions {
        name: format!("slotpool-{name}"),
        tls_ca: Some(pki.ca_cert.clone()),
        tls_cert: Some(files.cert.clone()),
        tls_key: Some(files.key.clone()),
        ..Default::default()
    }
}

/// A server with `pki`'s certificate that requires client certificates from its CA.
async fn tls_server(pki: &Pki) -> NatsServer {
    NatsServer::start_with_config(&pki::tls_server_block(pki, true), client(pki, "launcher")).await
}

/// Connects with `opts` to `server`, expecting a refusal; returns its message.
async fn refused(server: &NatsServer, opts: NatsOptions) -> String {
    let opts = NatsOptions {
        url: server.url(),
        ..opts
    };
    match tokio::time::timeout(REFUSAL, Bus::connect(&opts)).await {
        Err(_) => panic!("connecting with {opts:?}: no answer within {REFUSAL:?}"),
        Ok(Ok(_)) => panic!("connecting with {opts:?} succeeded"),
        Ok(Err(err @ BusError::Connect { .. })) => err.to_string(),
        Ok(Err(err)) => panic!("connecting with {opts:?}: expected a connect error, got {err}"),
    }
}

#[tokio::test]
async fn clients_with_a_certificate_from_the_ca_read_and_write() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path());
    let server = tls_server(&pki).await;
    assert!(
        server.url().starts_with("tls://127.0.0.1:"),
        "{}",
        server.url()
    );

    let agent = Bus::connect(&NatsOptions {
        url: server.url(),
        creds: Some(server.creds(Role::Agent, "tls-check")),
        ..client(&pki, "agent")
    })
    .await
    .unwrap_or_else(|err| panic!("the agent connecting over TLS: {err}"));
    agent
        .agents
        .put("tls-check", &"written over TLS", None)
        .await
        .unwrap();

    let operator = Bus::connect(&NatsOptions {
        url: server.url(),
        creds: Some(server.creds(Role::Operator, "operator")),
        ..client(&pki, "operator")
    })
    .await
    .unwrap_or_else(|err| panic!("the operator connecting over TLS: {err}"));
    let read = operator.agents.get::<String>("tls-check").await.unwrap();
    assert_eq!(read.map(|v| v.value).as_deref(), Some("written over TLS"));
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path());
    let server = tls_server(&pki).await;
    let message = refused(
        &server,
        NatsOptions {
            tls_ca: Some(pki.ca_cert.clone()),
            ..Default::default()
        },
    )
    .await;
    assert!(message.contains(&server.url()), "{message}");
    assert!(message.contains("CertificateRequired"), "{message}");
}

#[tokio::test]
async fn another_installations_pki_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(&dir.path().join("ours"));
    let theirs = make_pki(&dir.path().join("theirs"));
    let server = tls_server(&pki).await;

    // The client does not trust our server's certificate.
    let message = refused(
        &server,
        NatsOptions {
            tls_ca: Some(theirs.ca_cert.clone()),
            ..client(&pki, "agent")
        },
    )
    .await;
    assert!(message.contains("UnknownIssuer"), "{message}");

    // The server does not trust their client certificate.
    let message = refused(
        &server,
        NatsOptions {
            tls_ca: Some(pki.ca_cert.clone()),
            ..client(&theirs, "agent")
        },
    )
    .await;
    assert!(message.contains("UnknownCA"), "{message}");
}

#[test]
fn keys_are_private_and_certificates_say_what_they_are_for() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path());
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    for key in [&pki.ca_key, &pki.server_key]
        .into_iter()
        .chain(pki.clients.iter().map(|c| &c.key))
    {
        assert_eq!(mode(key), 0o600, "{}", key.display());
    }
    for cert in [&pki.ca_cert, &pki.server_cert]
        .into_iter()
        .chain(pki.clients.iter().map(|c| &c.cert))
    {
        assert_eq!(mode(cert), 0o644, "{}", cert.display());
    }

    // A second opinion from OpenSSL on what the certificates say.
    let server = openssl_text(&pki.server_cert);
    assert!(server.contains("DNS:localhost"), "{server}");
    assert!(server.contains("IP Address:127.0.0.1"), "{server}");
    assert!(server.contains("TLS Web Server Authentication"), "{server}");
    // A server of a cluster presents it when it dials another's route.
    assert!(server.contains("TLS Web Client Authentication"), "{server}");
    assert!(server.contains("ASN1 OID: prime256v1"), "{server}");
    for c in &pki.clients {
        let text = openssl_text(&c.cert);
        assert!(text.contains(&format!("CN = {}", c.name)), "{text}");
        assert!(text.contains("TLS Web Client Authentication"), "{text}");
        assert!(!text.contains("TLS Web Server Authentication"), "{text}");
    }
    let ca = openssl_text(&pki.ca_cert);
    assert!(ca.contains("CA:TRUE"), "{ca}");
}

/// `openssl x509 -noout -text` of `cert`. Fails (does not skip) without openssl.
fn openssl_text(cert: &Path) -> String {
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(cert)
        .output()
        .unwrap_or_else(|err| panic!("running openssl (needed by this test): {err}"));
    assert!(
        out.status.success(),
        "openssl x509 -in {}: {}",
        cert.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn nats_server_reads_the_tls_block_whatever_the_directory_is_called() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(&dir.path().join(r#"nats "tls" \ keys"#));
    let config = dir.path().join("nats-server.conf");
    std::fs::write(&config, pki::tls_server_block(&pki, true)).unwrap();
    // `-t` checks the configuration, loading the certificates and keys, and exits.
    let out = Command::new(slotpool_tests::nats_server_binary())
        .arg("-c")
        .arg(&config)
        .arg("-t")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nats-server -t: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
