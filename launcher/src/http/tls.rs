//! HTTPS for the launcher's listener: `--http-tls-cert` and `--http-tls-key`, and with
//! `--http-client-ca` a client certificate from that CA on every connection.
//!
//! The files are read and checked once, before the launcher starts: a missing file, a
//! file with no certificate or key in it, or a key that does not belong to the
//! certificate stops `slotpool serve` with the file and what is wrong.

use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// The certificate files given on the command line.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// The server's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) a client's certificate must chain to; none: no client
    /// certificate is asked for.
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path}: {detail}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error(
        "--http-tls-key {key} does not fit --http-tls-cert {cert} \
         (the key is not the certificate's, or the certificate is unusable): {source}"
    )]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

const CERT: &str = "--http-tls-cert";
const KEY: &str = "--http-tls-key";
const CLIENT_CA: &str = "--http-client-ca";

/// Reads and checks `files`: the acceptor every connection is handed to.
pub(crate) fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = certificates(CERT, &files.cert)?;
    let key = private_key(&files.key)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Mismatch {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates(CLIENT_CA, path)? {
                roots
                    .add(cert)
                    .map_err(|err| invalid(CLIENT_CA, path, err))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|err| invalid(CLIENT_CA, path, err))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|source| TlsError::Mismatch {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn invalid(what: &'static str, path: &Path, detail: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// The PEM certificates in `path`, at least one.
fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| invalid(what, path, format!("not PEM certificates: {err}")))?;
    if certs.is_empty() {
        return Err(invalid(
            what,
            path,
            "no certificate in it (expected PEM \"BEGIN CERTIFICATE\" blocks)",
        ));
    }
    Ok(certs)
}

/// The one PEM private key in `path`.
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(KEY, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|err| match err {
        rustls_pki_types::pem::Error::NoItemsFound => invalid(
            KEY,
            path,
            "no private key in it (expected a PEM \"BEGIN PRIVATE KEY\" block)",
        ),
        err => invalid(KEY, path, format!("not a PEM private key: {err}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path) -> TlsFiles {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let files = TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            client_ca: None,
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }

    #[test]
    fn a_certificate_and_its_key_are_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let files = files(dir.path());
        assert!(acceptor(&files).is_ok());
        // Its own certificate as the client CA works too.
        assert!(acceptor(&TlsFiles {
            client_ca: Some(files.cert.clone()),
            ..files
        })
        .is_ok());
    }

    #[test]
    fn each_wrong_file_is_named_with_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let good = files(dir.path());
        let missing = dir.path().join("missing.pem");
        let err = acceptor(&TlsFiles {
            cert: missing.clone(),
            ..good.clone()
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("reading --http-tls-cert") && err.contains("missing.pem"),
            "{err}"
        );

        // The key file given as the certificate, the certificate as the key.
        let err = acceptor(&TlsFiles {
            cert: good.key.clone(),
            key: good.cert.clone(),
            client_ca: None,
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--http-tls-cert") && err.contains("no certificate"),
            "{err}"
        );
        let err = acceptor(&TlsFiles {
            key: good.cert.clone(),
            ..good.clone()
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--http-tls-key") && err.contains("no private key"),
            "{err}"
        );

        // Another certificate's key.
        let other = dir.path().join("other");
        std::fs::create_dir(&other).unwrap();
        let other = files(&other);
        let err = acceptor(&TlsFiles {
            key: other.key,
            ..good.clone()
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(err.contains("does not fit"), "{err}");

        let err = acceptor(&TlsFiles {
            client_ca: Some(good.key.clone()),
            ..good
        })
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--http-client-ca") && err.contains("no certificate"),
            "{err}"
        );
    }
}
