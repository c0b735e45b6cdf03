//! The bearer token of slotpool's HTTP listeners (`slotpool serve --http` and
//! `slotpool-agent --metrics`): one rule for when a listener may be reached from other
//! hosts, and one way to read and check the token.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum BearerError {
    #[error("reading the HTTP token file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the HTTP token file {0} is empty")]
    Empty(PathBuf),
}

/// A token HTTP clients must send as `Authorization: Bearer TOKEN`.
#[derive(Clone)]
pub struct BearerToken(String);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(…)")
    }
}

impl BearerToken {
    /// The token in `path`, without surrounding white space.
    pub fn read(path: &Path) -> Result<BearerToken, BearerError> {
        let text = std::fs::read_to_string(path).map_err(|source| BearerError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(BearerError::Empty(path.to_path_buf()));
        }
        Ok(BearerToken(token.to_string()))
    }

    /// Whether an `Authorization` header's value carries this token; compared in time
    /// independent of where the bytes differ.
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        authorization
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same(given.trim().as_bytes(), self.0.as_bytes()))
    }
}

/// Whether a listener on `addr` may serve without a token: only on loopback, unless the
/// listener asks for client certificates.
pub fn may_serve_without_token(addr: SocketAddr, client_certificates: bool) -> bool {
    addr.ip().is_loopback() || client_certificates
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_read_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let token = BearerToken::read(&path).unwrap();
        assert!(token.accepts(Some("Bearer s3cret")));
        assert!(!token.accepts(Some("Bearer s3cre")));
        assert!(!token.accepts(Some("s3cret")));
        assert!(!token.accepts(None));
        std::fs::write(&path, " \n").unwrap();
        assert!(matches!(
            BearerToken::read(&path),
            Err(BearerError::Empty(_))
        ));
        assert!(matches!(
            BearerToken::read(&dir.path().join("missing")),
            Err(BearerError::Read { .. })
        ));
    }

    #[test]
    fn only_loopback_or_client_certificates_go_without_a_token() {
        assert!(may_serve_without_token(
            "127.0.0.1:1".parse().unwrap(),
            false
        ));
        assert!(may_serve_without_token("[::1]:1".parse().unwrap(), false));
        assert!(!may_serve_without_token(
            "0.0.0.0:1".parse().unwrap(),
            false
        ));
        assert!(may_serve_without_token("0.0.0.0:1".parse().unwrap(), true));
    }
}
