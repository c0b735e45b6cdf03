//! A small PKI for a NATS installation that has no CA of its own: one CA, a certificate
//! for nats-server and a client certificate per slotpool component, written as PEM files
//! into one directory, and the `tls { }` block that points nats-server at them.
//!
//! Keys are ECDSA P-256. Private keys are created with mode 0600, so they are never
//! readable by others, not even for a moment; certificates get 0644. Each file is written
//! under a temporary name in the same directory and then moved into place, so a file
//! that exists is complete. Without [`PkiPlan::overwrite`] nothing is replaced:
//! [`write_pki`] looks at every name before it generates anything, and the final move
//! refuses to replace a file that appeared in the meantime. A failure part-way (a full
//! disk) can leave some of the files written; the error names the one that failed.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256,
};
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use time::OffsetDateTime;

/// Mode of private keys.
pub const KEY_MODE: u32 = 0o600;
/// Mode of certificates.
pub const CERT_MODE: u32 = 0o644;
/// Mode of the directory, when [`write_pki`] creates it (it holds the keys).
pub const DIR_MODE: u32 = 0o700;
/// Certificates are valid from this long before they were made, for hosts whose clocks
/// are behind the one that made them.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60 * 60);
/// Seconds nats-server gives a client to finish the TLS handshake (`timeout` in the
/// `tls` block): generous, for busy hosts.
pub const TLS_HANDSHAKE_TIMEOUT_SECS: u32 = 5;

/// What to make. Plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PkiPlan {
    /// Where the files go; created (mode 0700) if missing.
    pub dir: PathBuf,
    /// DNS names and IP addresses the server certificate is valid for (`localhost`,
    /// `127.0.0.1`, `nats.example.com`). At least one.
    pub server_names: Vec<String>,
    /// Names to issue client certificates for (`launcher`, `agent`, `operator`); each is
    /// the certificate's CN and the start of its file names. Letters, digits, `.`, `_`
    /// and `-`; not `ca` or `server`.
    pub clients: Vec<String>,
    /// How long every certificate, the CA's included, is valid.
    pub validity_days: u32,
    /// Replace files that exist (otherwise [`write_pki`] refuses before writing anything).
    pub overwrite: bool,
}

/// The files [`write_pki`] wrote; every path is absolute.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pki {
    pub dir: PathBuf,
    /// `ca.pem`
    pub ca_cert: PathBuf,
    /// `ca-key.pem`
    pub ca_key: PathBuf,
    /// `server-cert.pem`
    pub server_cert: PathBuf,
    /// `server-key.pem`
    pub server_key: PathBuf,
    /// In the order of [`PkiPlan::clients`].
    pub clients: Vec<ClientFiles>,
}

/// A client's certificate and key: `<name>-cert.pem`, `<name>-key.pem`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientFiles {
    pub name: String,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    /// The file names for `clients` in `dir`.
    fn layout(dir: &Path, clients: &[String]) -> Pki {
        Pki {
            dir: dir.to_path_buf(),
            ca_cert: dir.join("ca.pem"),
            ca_key: dir.join("ca-key.pem"),
            server_cert: dir.join("server-cert.pem"),
            server_key: dir.join("server-key.pem"),
            clients: clients
                .iter()
                .map(|name| ClientFiles {
                    name: name.clone(),
                    cert: dir.join(format!("{name}-cert.pem")),
                    key: dir.join(format!("{name}-key.pem")),
                })
                .collect(),
        }
    }

    /// The files of client `name`.
    pub fn client(&self, name: &str) -> Option<&ClientFiles> {
        self.clients.iter().find(|c| c.name == name)
    }

    /// Every file, keys and certificates.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        [
            &self.ca_cert,
            &self.ca_key,
            &self.server_cert,
            &self.server_key,
        ]
        .into_iter()
        .chain(self.clients.iter().flat_map(|c| [&c.cert, &c.key]))
        .map(PathBuf::as_path)
    }
}

/// Why [`write_pki`] did not finish.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{path} exists; not replacing it (remove it or ask to overwrite)")]
    Exists { path: PathBuf },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("creating directory {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("making the certificate for {path}: {message}")]
    Certificate { path: PathBuf, message: String },
}

/// Makes a CA, a server certificate and the client certificates of `plan`, and writes
/// them with their keys into `plan.dir`.
pub fn write_pki(plan: &PkiPlan) -> Result<Pki, PkiError> {
    let dir = std::path::absolute(&plan.dir).map_err(|source| PkiError::CreateDir {
        path: plan.dir.clone(),
        source,
    })?;
    let pki = Pki::layout(&dir, &plan.clients);
    check(plan, &pki)?;
    if !plan.overwrite {
        if let Some(path) = pki.files().find(|p| fs::symlink_metadata(p).is_ok()) {
            return Err(PkiError::Exists {
                path: path.to_path_buf(),
            });
        }
    }

    // Everything is made in memory first: a certificate that cannot be made leaves no
    // files behind.
    let now = OffsetDateTime::now_utc();
    let validity = Validity {
        not_before: now - CLOCK_SKEW,
        // X.509 dates end with the year 9999.
        not_after: now
            .checked_add(time::Duration::days(plan.validity_days.into()))
            .filter(|end| end.year() <= 9999)
            .ok_or_else(|| PkiError::Invalid {
                path: pki.dir.clone(),
                reason: format!("validity of {} days ends after 9999", plan.validity_days),
            })?,
    };
    let cert_error = |path: &Path| {
        let path = path.to_path_buf();
        move |err: rcgen::Error| PkiError::Certificate {
            path,
            message: err.to_string(),
        }
    };
    let ca = make_ca(&validity).map_err(cert_error(&pki.ca_cert))?;
    let ca_key = ca.key().serialize_pem();
    let server = make_leaf(
        &plan.server_names[0],
        plan.server_names.clone(),
        // A server of a cluster also presents it when it dials the others' routes.
        &[
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        &validity,
        &ca,
    )
    .map_err(cert_error(&pki.server_cert))?;
    let mut clients = Vec::with_capacity(pki.clients.len());
    for c in &pki.clients {
        clients.push(
            make_leaf(
                &c.name,
                Vec::new(),
                &[ExtendedKeyUsagePurpose::ClientAuth],
                &validity,
                &ca,
            )
            .map_err(cert_error(&c.cert))?,
        );
    }

    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(&dir)
        .map_err(|source| PkiError::CreateDir {
            path: dir.clone(),
            source,
        })?;
    let write = |path: &Path, pem: &str, mode: u32| write_file(path, pem, mode, plan.overwrite);
    write(&pki.ca_key, &ca_key, KEY_MODE)?;
    write(&pki.ca_cert, &ca.pem(), CERT_MODE)?;
    write(&pki.server_key, &server.key, KEY_MODE)?;
    write(&pki.server_cert, &server.cert, CERT_MODE)?;
    for (files, made) in pki.clients.iter().zip(&clients) {
        write(&files.key, &made.key, KEY_MODE)?;
        write(&files.cert, &made.cert, CERT_MODE)?;
    }
    Ok(pki)
}

/// The `tls { }` block of a nats-server config file for `pki`'s server certificate; with
/// `verify_clients`, clients must present a certificate from `pki`'s CA.
pub fn tls_server_block(pki: &Pki, verify_clients: bool) -> String {
    format!(
        "tls {{\n  cert_file: {}\n  key_file: {}\n  ca_file: {}\n  verify: {verify_clients}\n  timeout: {TLS_HANDSHAKE_TIMEOUT_SECS}\n}}\n",
        quoted(&pki.server_cert),
        quoted(&pki.server_key),
        quoted(&pki.ca_cert),
    )
}

/// `path` as a double-quoted string of the nats-server config syntax.
fn quoted(path: &Path) -> String {
    let text = path.to_string_lossy();
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Refuses plans whose names would not make usable, distinct files.
fn check(plan: &PkiPlan, pki: &Pki) -> Result<(), PkiError> {
    let invalid = |path: &Path, reason: String| PkiError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    if plan.validity_days == 0 {
        return Err(invalid(&pki.dir, "validity of 0 days".into()));
    }
    if plan.server_names.is_empty() {
        return Err(invalid(
            &pki.server_cert,
            "no server names (DNS names or IP addresses) to issue it for".into(),
        ));
    }
    for (i, c) in pki.clients.iter().enumerate() {
        let name = &c.name;
        let well_formed = !name.is_empty()
            && !name.starts_with('.')
            && name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'));
        if !well_formed {
            return Err(invalid(
                &c.cert,
                format!(
                    "client name {name:?}: use letters, digits, '.', '_' and '-' (not first '.')"
                ),
            ));
        }
        if name == "ca" || name == "server" {
            return Err(invalid(
                &c.cert,
                format!("client name {name:?} would share files with the {name}"),
            ));
        }
        if pki.clients[..i].iter().any(|other| other.name == *name) {
            return Err(invalid(&c.cert, format!("client {name:?} named twice")));
        }
    }
    Ok(())
}

struct Validity {
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
}

/// A certificate and its key, PEM.
struct Made {
    cert: String,
    key: String,
}

fn subject(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "slotpool");
    dn.push(DnType::CommonName, common_name);
    dn
}

fn make_ca(validity: &Validity) -> Result<CertifiedIssuer<'static, KeyPair>, rcgen::Error> {
    let mut params = CertificateParams::default();
    // A unique name, so that CAs of several installations (or an old and a new one) can
    // be told apart.
    params.distinguished_name = subject(&format!("slotpool CA {}", ulid::Ulid::new()));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    CertifiedIssuer::self_signed(params, KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?)
}

/// A certificate for `common_name` with the subject alternative names `sans` (each an IP
/// address or a DNS name) and the extended key usages `usages`, signed by `ca`.
fn make_leaf(
    common_name: &str,
    sans: Vec<String>,
    usages: &[ExtendedKeyUsagePurpose],
    validity: &Validity,
    ca: &CertifiedIssuer<'_, KeyPair>,
) -> Result<Made, rcgen::Error> {
    let mut params = CertificateParams::new(sans)?;
    params.distinguished_name = subject(common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = usages.to_vec();
    params.use_authority_key_identifier_extension = true;
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let cert = params.signed_by(&key, ca)?;
    Ok(Made {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Writes `contents` to `path` with exactly `mode`: into a new temporary file created
/// with that mode, then moved to `path` (replacing it only with `overwrite`).
fn write_file(path: &Path, contents: &str, mode: u32, overwrite: bool) -> Result<(), PkiError> {
    let file_name = path
        .file_name()
        .expect("pki file paths end in a file name")
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{file_name}.{:016x}.tmp", rand::random::<u64>()));
    // `create_new` is O_EXCL: it neither follows a symlink nor reuses a file someone
    // else made, and the file has `mode` (less the umask) from its first moment.
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|source| PkiError::Write {
            path: tmp.clone(),
            source,
        })?;
    let placed = (|| {
        // The umask may have taken bits from `mode` (a certificate's 0644); set it exactly.
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        if overwrite {
            fs::rename(&tmp, path)
        } else {
            // A hard link fails if `path` exists, where a rename would replace it.
            fs::hard_link(&tmp, path)?;
            fs::remove_file(&tmp)
        }
    })();
    placed.map_err(|source| {
        let _ = fs::remove_file(&tmp);
        if source.kind() == io::ErrorKind::AlreadyExists && !overwrite {
            PkiError::Exists {
                path: path.to_path_buf(),
            }
        } else {
            PkiError::Write {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
    use webpki::{EndEntityCert, KeyUsage};

    /// id-kp-serverAuth and id-kp-clientAuth, DER-encoded OID contents.
    const EKU_SERVER_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01];
    const EKU_CLIENT_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x02];

    fn plan(dir: &Path) -> PkiPlan {
        PkiPlan {
            dir: dir.to_path_buf(),
            server_names: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
            clients: vec!["launcher".into(), "agent".into(), "operator".into()],
            validity_days: 30,
            overwrite: false,
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    fn cert(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path).unwrap()
    }

    /// Whether `leaf` chains to `ca` for `usage` (an EKU that must be present).
    fn verifies(ca: &Path, leaf: &Path, usage: &'static [u8]) -> Result<(), webpki::Error> {
        let ca = cert(ca);
        let anchors = [webpki::anchor_from_trusted_cert(&ca).unwrap()];
        let leaf = cert(leaf);
        let leaf = EndEntityCert::try_from(&leaf).unwrap();
        leaf.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &[],
            UnixTime::now(),
            KeyUsage::required(usage),
            None,
            None,
        )
        .map(|_| ())
    }

    fn valid_for(leaf: &Path, name: &str) -> bool {
        let leaf = cert(leaf);
        let leaf = EndEntityCert::try_from(&leaf).unwrap();
        let name = ServerName::try_from(name).unwrap();
        leaf.verify_is_valid_for_subject_name(&name).is_ok()
    }

    #[test]
    fn writes_every_file_with_its_mode() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tls");
        let pki = write_pki(&plan(&dir)).unwrap();
        assert_eq!(pki.dir, dir);
        assert_eq!(mode(&dir), DIR_MODE);
        let names: Vec<_> = pki
            .files()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "ca.pem",
                "ca-key.pem",
                "server-cert.pem",
                "server-key.pem",
                "launcher-cert.pem",
                "launcher-key.pem",
                "agent-cert.pem",
                "agent-key.pem",
                "operator-cert.pem",
                "operator-key.pem",
            ]
        );
        for path in [&pki.ca_key, &pki.server_key]
            .into_iter()
            .chain(pki.clients.iter().map(|c| &c.key))
        {
            assert_eq!(mode(path), KEY_MODE, "{}", path.display());
            let text = fs::read_to_string(path).unwrap();
            assert!(text.starts_with("-----BEGIN PRIVATE KEY-----"), "{text}");
        }
        for path in [&pki.ca_cert, &pki.server_cert]
            .into_iter()
            .chain(pki.clients.iter().map(|c| &c.cert))
        {
            assert_eq!(mode(path), CERT_MODE, "{}", path.display());
        }
        // No temporary files left behind.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), names.len());
    }

    #[test]
    fn refuses_to_overwrite_unless_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let first = write_pki(&plan(tmp.path())).unwrap();
        let ca_before = fs::read(&first.ca_cert).unwrap();

        let err = write_pki(&plan(tmp.path())).unwrap_err();
        assert!(
            matches!(&err, PkiError::Exists { path } if *path == first.ca_cert),
            "{err}"
        );
        assert!(err.to_string().contains("ca.pem"), "{err}");
        assert_eq!(fs::read(&first.ca_cert).unwrap(), ca_before);

        let again = write_pki(&PkiPlan {
            overwrite: true,
            ..plan(tmp.path())
        })
        .unwrap();
        assert_eq!(again, first);
        assert_ne!(fs::read(&again.ca_cert).unwrap(), ca_before);
        assert_eq!(mode(&again.server_key), KEY_MODE);
        assert_eq!(mode(&again.server_cert), CERT_MODE);
    }

    #[test]
    fn one_existing_file_stops_everything_before_it_starts() {
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("operator-key.pem");
        fs::write(&key, "mine").unwrap();
        let err = write_pki(&plan(tmp.path())).unwrap_err();
        assert!(
            matches!(&err, PkiError::Exists { path } if *path == key),
            "{err}"
        );
        assert_eq!(fs::read_to_string(&key).unwrap(), "mine");
        assert!(!tmp.path().join("ca.pem").exists());
        assert!(!tmp.path().join("ca-key.pem").exists());
    }

    #[test]
    fn the_final_move_does_not_replace_a_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("x.pem");
        fs::write(&path, "first").unwrap();
        let err = write_file(&path, "second", KEY_MODE, false).unwrap_err();
        assert!(matches!(&err, PkiError::Exists { .. }), "{err}");
        assert_eq!(fs::read_to_string(&path).unwrap(), "first");
        assert_eq!(
            fs::read_dir(tmp.path()).unwrap().count(),
            1,
            "temp file left"
        );
        write_file(&path, "second", KEY_MODE, true).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "second");
        assert_eq!(mode(&path), KEY_MODE);
    }

    #[test]
    fn server_certificate_has_the_names_and_server_and_route_auth() {
        let tmp = tempfile::tempdir().unwrap();
        let pki = write_pki(&plan(tmp.path())).unwrap();
        verifies(&pki.ca_cert, &pki.server_cert, EKU_SERVER_AUTH).unwrap();
        for name in ["localhost", "127.0.0.1", "::1"] {
            assert!(valid_for(&pki.server_cert, name), "{name}");
        }
        for name in ["example.com", "127.0.0.2", "launcher"] {
            assert!(!valid_for(&pki.server_cert, name), "{name}");
        }
        // A server of a cluster presents it when it dials another's route.
        verifies(&pki.ca_cert, &pki.server_cert, EKU_CLIENT_AUTH).unwrap();
    }

    #[test]
    fn client_certificates_are_for_client_auth_only() {
        let tmp = tempfile::tempdir().unwrap();
        let pki = write_pki(&plan(tmp.path())).unwrap();
        for c in &pki.clients {
            verifies(&pki.ca_cert, &c.cert, EKU_CLIENT_AUTH).unwrap();
            assert!(verifies(&pki.ca_cert, &c.cert, EKU_SERVER_AUTH).is_err());
            let der = cert(&c.cert);
            // The CN is the client's name (a UTF8String in the subject).
            assert!(
                der.windows(c.name.len()).any(|w| w == c.name.as_bytes()),
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn another_installations_ca_does_not_vouch_for_these() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let a = write_pki(&plan(a.path())).unwrap();
        let b = write_pki(&plan(b.path())).unwrap();
        assert!(verifies(&b.ca_cert, &a.server_cert, EKU_SERVER_AUTH).is_err());
        assert!(verifies(&a.ca_cert, &b.clients[0].cert, EKU_CLIENT_AUTH).is_err());
    }

    #[test]
    fn refuses_names_that_would_collide_or_escape() {
        let tmp = tempfile::tempdir().unwrap();
        for (clients, needle) in [
            (vec!["ca"], "\"ca\""),
            (vec!["server"], "\"server\""),
            (vec!["../x"], "\"../x\""),
            (vec![""], "\"\""),
            (vec![".hidden"], "\".hidden\""),
            (vec!["agent", "agent"], "named twice"),
        ] {
            let err = write_pki(&PkiPlan {
                clients: clients.into_iter().map(String::from).collect(),
                ..plan(tmp.path())
            })
            .unwrap_err();
            assert!(matches!(err, PkiError::Invalid { .. }), "{err}");
            assert!(err.to_string().contains(needle), "{err}");
        }
        let no_names = PkiPlan {
            server_names: Vec::new(),
            ..plan(tmp.path())
        };
        assert!(matches!(
            write_pki(&no_names),
            Err(PkiError::Invalid { .. })
        ));
        for days in [0, u32::MAX] {
            let plan = PkiPlan {
                validity_days: days,
                ..plan(tmp.path())
            };
            assert!(matches!(write_pki(&plan), Err(PkiError::Invalid { .. })));
        }
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn tls_block_names_the_files() {
        let pki = Pki::layout(Path::new("/etc/slotpool/nats \"tls\""), &[]);
        let block = tls_server_block(&pki, true);
        assert_eq!(
            block,
            "tls {\n  cert_file: \"/etc/slotpool/nats \\\"tls\\\"/server-cert.pem\"\n  \
             key_file: \"/etc/slotpool/nats \\\"tls\\\"/server-key.pem\"\n  \
             ca_file: \"/etc/slotpool/nats \\\"tls\\\"/ca.pem\"\n  verify: true\n  timeout: 5\n}\n"
        );
        assert!(tls_server_block(&pki, false).contains("verify: false"));
    }
}
