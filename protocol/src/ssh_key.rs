//! The one check of an SSH public key a requester hands in: it becomes the only line of
//! a slot's `authorized_keys`, so anything but a single plain key would let something
//! else log in (a second key after `\r` or a newline, `command=`/`from=` options, NUL).
//!
//! A valid key is exactly `<type> <base64 blob> [comment]`: the type one of
//! [`KEY_TYPES`], the blob valid base64 whose decoded SSH wire form starts with the same
//! type (a u32 length, then the name), the comment printable ASCII, the whole at most
//! [`MAX_KEY_LEN`] bytes. The launcher checks submissions with it and the agent checks
//! every `prepare_slot` with it again.

use base64::Engine;

/// Longest key line accepted (an RSA 16384-bit key is about 2.8 KiB).
pub const MAX_KEY_LEN: usize = 8 * 1024;
/// The key types OpenSSH accepts for user keys.
pub const KEY_TYPES: [&str; 7] = [
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
];

/// What is wrong with a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the key is empty")]
    Empty,
    #[error("the key is {len} bytes; at most {MAX_KEY_LEN} are allowed")]
    TooLong { len: usize },
    #[error("the key holds a control character {found:?} at byte {at}: it must be one line without control characters")]
    ControlCharacter { found: char, at: usize },
    #[error("the key holds a non-ASCII character at byte {at}")]
    NotAscii { at: usize },
    #[error("the key must be '<type> <base64> [comment]', without options before the type; {found:?} is not a known key type (known: {})", KEY_TYPES.join(", "))]
    UnknownType { found: String },
    #[error("the key has no base64 part after its type {key_type}")]
    NoBody { key_type: String },
    #[error("the key's base64 part is not valid base64: {reason}")]
    BadBase64 { reason: String },
    #[error("the key says {key_type} but its base64 part holds a {found:?} key")]
    TypeMismatch { key_type: String, found: String },
}

/// Checks that `key` is exactly one plain OpenSSH public key line (see the module docs).
pub fn validate_public_key(key: &str) -> Result<(), KeyError> {
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: key.len() });
    }
    for (at, c) in key.char_indices() {
        if !c.is_ascii() {
            return Err(KeyError::NotAscii { at });
        }
        if c.is_ascii_control() {
            return Err(KeyError::ControlCharacter { found: c, at });
        }
    }
    let mut parts = key.splitn(3, ' ');
    let key_type = parts.next().unwrap_or_default();
    if key.trim().is_empty() {
        return Err(KeyError::Empty);
    }
    if !KEY_TYPES.contains(&key_type) {
        return Err(KeyError::UnknownType {
            found: key_type.chars().take(64).collect(),
        });
    }
    let body = parts.next().unwrap_or_default();
    if body.is_empty() {
        return Err(KeyError::NoBody {
            key_type: key_type.to_string(),
        });
    }
    let blob = base64::engine::general_purpose::STANDARD
        .decode(body)
        .map_err(|e| KeyError::BadBase64 {
            reason: e.to_string(),
        })?;
    let found = wire_type(&blob);
    if found != Some(key_type.as_bytes()) {
        return Err(KeyError::TypeMismatch {
            key_type: key_type.to_string(),
            found: String::from_utf8_lossy(found.unwrap_or_default())
                .chars()
                .take(64)
                .collect(),
        });
    }
    Ok(())
}

/// The key type at the start of an SSH wire-format key blob (u32 big-endian length, then
/// that many bytes).
fn wire_type(blob: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(blob.get(..4)?.try_into().ok()?) as usize;
    blob.get(4..4usize.checked_add(len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ED25519: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGaKVw3eUGESvO1UcmfBj0MJKaPSCWfAXDprq+uHFDzc me@host";
    const ECDSA256: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBFAp8czs3v8Q1Rz6yoCJ54vSDqxnorJ0oXIv+9w3MUhAyIhYcYR56uIV3KF1lcWkdJYIMVDOPJMCY6rNXIPgPCg= root@vm";

    /// A key line of `key_type` whose blob says `blob_type`, with some key bytes after.
    fn synthetic(key_type: &str, blob_type: &str) -> String {
        let mut blob = (blob_type.len() as u32).to_be_bytes().to_vec();
        blob.extend_from_slice(blob_type.as_bytes());
        blob.extend_from_slice(&[0, 0, 0, 32]);
        blob.extend_from_slice(&[7; 32]);
        let body = base64::engine::general_purpose::STANDARD.encode(blob);
        format!("{key_type} {body} someone@example")
    }

    #[test]
    fn good_keys_of_every_type_pass() {
        validate_public_key(ED25519).unwrap();
        validate_public_key(ECDSA256).unwrap();
        validate_public_key(ED25519.rsplit_once(' ').unwrap().0).unwrap();
        for t in KEY_TYPES {
            validate_public_key(&synthetic(t, t)).unwrap_or_else(|e| panic!("{t}: {e}"));
        }
    }

    #[test]
    fn forged_lines_are_refused_saying_why() {
        let other = synthetic("ssh-rsa", "ssh-rsa");
        let cases: [(String, &str); 9] = [
            (format!("{ED25519}\r{other}"), "control character '\\r'"),
            (format!("{ED25519}\n{other}"), "control character '\\n'"),
            (format!("{ED25519}\0{other}"), "control character '\\0'"),
            (format!("command=\"/bin/sh\" {ED25519}"), "without options"),
            (
                format!("from=\"*\",no-pty {ED25519}"),
                "not a known key type",
            ),
            (
                synthetic("ssh-ed25519", "ssh-rsa"),
                "holds a \"ssh-rsa\" key",
            ),
            ("ssh-ed25519 AAAA!!!! me".into(), "not valid base64"),
            ("ssh-ed25519".into(), "no base64 part"),
            ("x".repeat(MAX_KEY_LEN + 1), "at most"),
        ];
        for (key, says) in cases {
            let err = validate_public_key(&key).unwrap_err().to_string();
            assert!(err.contains(says), "{key:?}: {err}");
        }
        assert_eq!(validate_public_key(""), Err(KeyError::Empty));
        assert!(validate_public_key("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 trailing\t").is_err());
        assert!(validate_public_key("ssh-ed25519  AAAAC3NzaC1lZDI1NTE5").is_err());
        assert!(matches!(
            validate_public_key(&format!("{ED25519} caf\u{e9}")),
            Err(KeyError::NotAscii { .. })
        ));
        // A blob too short to hold its type.
        let err = validate_public_key("ssh-ed25519 AAAAC3Nz me").unwrap_err();
        assert!(matches!(err, KeyError::TypeMismatch { .. }), "{err}");
    }
}
