//! NATS JWTs (decentralised authentication, claims version 2) signed with nkeys, and the
//! `.creds` file format that carries a user JWT with its seed.
//!
//! Written here rather than taken from a crate: the crates that encode NATS JWTs cover
//! user and account claims but not operator claims or an account's JetStream limits,
//! which a server needs before it lets the account use KV. The format is small (a JSON
//! header and claims, base64url, an ed25519 signature over both); the cryptography is
//! the `nkeys` crate's, the same one async-nats uses to sign its connection nonce.

use super::AuthError;
use data_encoding::{BASE32_NOPAD, BASE64URL_NOPAD};
use nkeys::KeyPair;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha512_256};

const HEADER: &str = r#"{"typ":"JWT","alg":"ed25519-nkey"}"#;

/// The registered claims every NATS JWT has; `nats` holds the kind-specific part.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Claims {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exp: Option<u64>,
    #[serde(default)]
    pub jti: String,
    pub iat: u64,
    pub iss: String,
    pub name: String,
    pub sub: String,
    pub nats: Value,
}

/// The JetStream-enabled account limits slotpool's account gets (all unlimited: the
/// server's own `jetstream` block bounds memory and disk).
pub fn account_nats(signing_keys: &[String]) -> Value {
    json!({
        "limits": {
            "subs": -1, "data": -1, "payload": -1,
            "imports": -1, "exports": -1, "wildcards": true, "conn": -1, "leaf": -1,
            "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1
        },
        "signing_keys": signing_keys,
        "default_permissions": { "pub": {}, "sub": {} },
        "type": "account",
        "version": 2
    })
}

/// The system account: no JetStream.
pub fn system_account_nats() -> Value {
    json!({
        "limits": {
            "subs": -1, "data": -1, "payload": -1,
            "imports": -1, "exports": -1, "wildcards": true, "conn": -1, "leaf": -1
        },
        "default_permissions": { "pub": {}, "sub": {} },
        "type": "account",
        "version": 2
    })
}

/// An operator's claims: the system account, and the keys that may sign accounts beside
/// the operator's own.
pub fn operator_nats(system_account: &str, signing_keys: &[String]) -> Value {
    json!({
        "system_account": system_account,
        "signing_keys": signing_keys,
        "type": "operator",
        "version": 2
    })
}

/// A user's claims: exactly the subjects it may publish and subscribe to, and whether it
/// may answer requests sent to it (one reply each).
pub fn user_nats(
    issuer_account: &str,
    publish: &[String],
    subscribe: &[String],
    responses: bool,
    tags: &[String],
) -> Value {
    let mut nats = json!({
        "pub": { "allow": publish },
        "sub": { "allow": subscribe },
        "subs": -1, "data": -1, "payload": -1,
        "issuer_account": issuer_account,
        "tags": tags,
        "type": "user",
        "version": 2
    });
    if responses {
        // One reply per request received, within a minute (nanoseconds).
        nats["resp"] = json!({ "max": 1, "ttl": 60_000_000_000u64 });
    }
    nats
}

/// Signs `claims` with `signer` (whose public key becomes the issuer).
pub fn encode(mut claims: Claims, signer: &KeyPair) -> Result<String, AuthError> {
    claims.iss = signer.public_key();
    claims.jti = String::new();
    claims.jti = claims_id(&claims)?;
    let body = serde_json::to_vec(&claims).map_err(|e| AuthError::Encode(e.to_string()))?;
    let to_sign = format!(
        "{}.{}",
        BASE64URL_NOPAD.encode(HEADER.as_bytes()),
        BASE64URL_NOPAD.encode(&body)
    );
    let sig = signer
        .sign(to_sign.as_bytes())
        .map_err(|e| AuthError::Encode(e.to_string()))?;
    Ok(format!("{to_sign}.{}", BASE64URL_NOPAD.encode(&sig)))
}

/// The `jti`: a hash of the registered claims, as NATS tools compute it.
fn claims_id(claims: &Claims) -> Result<String, AuthError> {
    let registered = json!({
        "exp": claims.exp, "iat": claims.iat, "iss": claims.iss,
        "name": claims.name, "sub": claims.sub,
    });
    let bytes = serde_json::to_vec(&registered).map_err(|e| AuthError::Encode(e.to_string()))?;
    Ok(BASE32_NOPAD.encode(&Sha512_256::digest(bytes)))
}

/// Reads a JWT's claims and checks its signature against its own issuer. Whether that
/// issuer is trusted is the server's business; slotpool only reads its own identity from
/// its own credentials with this.
pub fn decode(jwt: &str) -> Result<Claims, AuthError> {
    let bad = |why: &str| AuthError::BadJwt(why.to_string());
    let mut parts = jwt.trim().split('.');
    let (Some(h), Some(b), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("not three dot-separated parts"));
    };
    let body = BASE64URL_NOPAD
        .decode(b.as_bytes())
        .map_err(|_| bad("claims are not base64url"))?;
    let sig = BASE64URL_NOPAD
        .decode(s.as_bytes())
        .map_err(|_| bad("signature is not base64url"))?;
    let claims: Claims = serde_json::from_slice(&body).map_err(|e| bad(&format!("claims: {e}")))?;
    let issuer = KeyPair::from_public_key(&claims.iss).map_err(|_| bad("issuer is no nkey"))?;
    issuer
        .verify(format!("{h}.{b}").as_bytes(), &sig)
        .map_err(|_| bad("signature does not match the issuer"))?;
    Ok(claims)
}

/// The text of a `.creds` file: the user JWT and its nkey seed, in the armour NATS
/// clients read.
pub fn creds_file(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    )
}

/// The JWT inside a `.creds` file's text.
pub fn jwt_of_creds(text: &str) -> Option<&str> {
    let mut lines = text.lines().map(str::trim);
    lines.find(|l| l.starts_with("-----BEGIN NATS USER JWT"))?;
    lines.next().filter(|l| !l.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user_claims(sub: &str) -> Claims {
        Claims {
            exp: Some(2_000_000_000),
            jti: String::new(),
            iat: 1_700_000_000,
            iss: String::new(),
            name: "ci".into(),
            sub: sub.into(),
            nats: user_nats(
                "Aaccount",
                &["a.>".into()],
                &["_INBOX.x.>".into()],
                true,
                &[],
            ),
        }
    }

    #[test]
    fn a_signed_jwt_decodes_to_its_claims() {
        let account = KeyPair::new_account();
        let user = KeyPair::new_user();
        let jwt = encode(user_claims(&user.public_key()), &account).unwrap();
        let claims = decode(&jwt).unwrap();
        assert_eq!(claims.iss, account.public_key());
        assert_eq!(claims.sub, user.public_key());
        assert_eq!(claims.nats["pub"]["allow"][0], "a.>");
        assert_eq!(claims.nats["resp"]["max"], 1);
        assert_eq!(claims.jti.len(), 52, "base32 of 32 bytes");
    }

    #[test]
    fn a_tampered_jwt_is_refused() {
        let account = KeyPair::new_account();
        let jwt = encode(user_claims(&KeyPair::new_user().public_key()), &account).unwrap();
        let mut parts: Vec<String> = jwt.split('.').map(String::from).collect();
        let mut claims: Value =
            serde_json::from_slice(&BASE64URL_NOPAD.decode(parts[1].as_bytes()).unwrap()).unwrap();
        claims["nats"]["pub"]["allow"][0] = json!(">");
        parts[1] = BASE64URL_NOPAD.encode(&serde_json::to_vec(&claims).unwrap());
        let err = decode(&parts.join(".")).unwrap_err();
        assert!(err.to_string().contains("signature"), "{err}");
        assert!(decode("a.b").is_err());
    }

    #[test]
    fn creds_files_carry_the_jwt() {
        let text = creds_file("eyJhbGc.x.y", "SUAseed");
        assert_eq!(jwt_of_creds(&text), Some("eyJhbGc.x.y"));
        assert!(text.contains("SUAseed"));
        assert_eq!(jwt_of_creds("nothing here"), None);
    }
}
