//! Bearer tokens for slotpool's HTTP API (`slotpool serve --http`), derived from bus
//! credentials, so that the API knows its callers as the bus does: the same user, role,
//! expiry and revocation.
//!
//! A token is `<user JWT>.<signature>`: the credential's JWT and, base64url, the
//! signature by the credential's nkey seed of [`SIGNED_PREFIX`] followed by that JWT.
//! Only who holds the seed can make it (ed25519 signatures are deterministic, so a
//! credential always gives the same token, and `slotpool http-token` can print it
//! again); a launcher checks it with no secret at all ([`TokenVerifier`]): the JWT must be
//! signed by the key that signed the launcher's own credential, for the same account, not
//! be expired, and carry a slotpool role; the signature must be the JWT's subject's.
//! Whether the credential was revoked is the launcher's to check against its
//! revocations, as the server does for the bus.

use super::jwt::{self, Claims};
use super::{AuthError, BusUser, Credentials, Role};
use crate::ids::is_key_token;
use data_encoding::BASE64URL_NOPAD;
use nkeys::KeyPair;

/// What a token's signature is over, before the JWT: a signature of the seed over
/// anything else (a NATS server nonce, say) is never a token.
pub const SIGNED_PREFIX: &str = "slotpool-http-token-v1:";

/// Why a token is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("not a slotpool token: {0}")]
    Malformed(String),
    #[error("the token's credential was not issued by this installation")]
    NotIssuedHere,
    #[error("the token's credential expired")]
    Expired,
    #[error("the token's signature is not its credential's")]
    BadSignature,
}

/// Who a valid token stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bearer {
    pub user: BusUser,
    /// The credential's user nkey (public): what revocations name.
    pub key: String,
    /// When the credential was issued (seconds since the epoch): a revocation covers the
    /// credentials of its key issued at or before its time.
    pub issued_at: u64,
}

/// The HTTP token of the credential `creds`.
pub fn http_token(creds: &Credentials) -> Result<String, AuthError> {
    let jwt = jwt::jwt_of_creds(creds.text())
        .ok_or_else(|| AuthError::BadJwt("no user JWT in the credentials".into()))?;
    let seed = seed_of_creds(creds.text())
        .ok_or_else(|| AuthError::BadJwt("no nkey seed in the credentials".into()))?;
    let key = KeyPair::from_seed(seed).map_err(|e| AuthError::BadJwt(e.to_string()))?;
    let signature = key
        .sign(format!("{SIGNED_PREFIX}{jwt}").as_bytes())
        .map_err(|e| AuthError::Encode(e.to_string()))?;
    Ok(format!("{jwt}.{}", BASE64URL_NOPAD.encode(&signature)))
}

/// The nkey seed inside a `.creds` file's text.
fn seed_of_creds(text: &str) -> Option<&str> {
    let mut lines = text.lines().map(str::trim);
    lines.find(|l| l.starts_with("-----BEGIN USER NKEY SEED"))?;
    lines.next().filter(|l| !l.is_empty())
}

/// Checks tokens against the issuer of one credential (the launcher's own).
#[derive(Clone, Debug)]
pub struct TokenVerifier {
    /// The key that signs this installation's users (the account's signing key).
    issuer: String,
    /// The account they belong to.
    account: String,
}

impl TokenVerifier {
    /// A verifier trusting the issuer of `creds` (the launcher's credential).
    pub fn of(creds: &Credentials) -> Result<TokenVerifier, AuthError> {
        let jwt = jwt::jwt_of_creds(creds.text())
            .ok_or_else(|| AuthError::BadJwt("no user JWT in the credentials".into()))?;
        let claims = jwt::decode(jwt)?;
        let account = issuer_account(&claims)
            .ok_or_else(|| AuthError::BadJwt("the JWT names no issuer account".into()))?;
        Ok(TokenVerifier {
            issuer: claims.iss,
            account,
        })
    }

    /// Who `token` stands for, if it is a valid token of this installation at `now`
    /// (seconds since the epoch).
    pub fn verify(&self, token: &str, now: u64) -> Result<Bearer, TokenError> {
        let malformed = |why: &str| TokenError::Malformed(why.to_string());
        let (jwt, signature) = token
            .trim()
            .rsplit_once('.')
            .ok_or_else(|| malformed("no signature"))?;
        let claims = jwt::decode(jwt).map_err(|e| TokenError::Malformed(e.to_string()))?;
        if claims.iss != self.issuer || issuer_account(&claims).as_deref() != Some(&self.account) {
            return Err(TokenError::NotIssuedHere);
        }
        if claims.exp.is_some_and(|exp| exp <= now) {
            return Err(TokenError::Expired);
        }
        let user = user_of(&claims).ok_or_else(|| malformed("no slotpool role or name"))?;
        let signature = BASE64URL_NOPAD
            .decode(signature.as_bytes())
            .map_err(|_| malformed("the signature is not base64url"))?;
        let key = KeyPair::from_public_key(&claims.sub)
            .map_err(|_| malformed("the JWT's subject is not a user nkey"))?;
        key.verify(format!("{SIGNED_PREFIX}{jwt}").as_bytes(), &signature)
            .map_err(|_| TokenError::BadSignature)?;
        Ok(Bearer {
            user,
            key: claims.sub,
            issued_at: claims.iat,
        })
    }
}

fn issuer_account(claims: &Claims) -> Option<String> {
    claims.nats["issuer_account"].as_str().map(str::to_string)
}

/// The bus user a credential's claims are for (its name and role tag).
pub(super) fn user_of(claims: &Claims) -> Option<BusUser> {
    let role = claims.nats["tags"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str()?.strip_prefix("slotpool-role:"))
        .find_map(Role::parse)?;
    if !is_key_token(&claims.name) {
        return None;
    }
    BusUser::new(role, &claims.name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Installation;
    use std::time::Duration;

    fn now() -> u64 {
        super::super::unix_now()
    }

    #[test]
    fn a_token_stands_for_its_credentials_user() {
        let inst = Installation::generate();
        let minter = inst.minter();
        let launcher = minter
            .mint(&BusUser::new(Role::Launcher, "l").unwrap(), None)
            .unwrap();
        let ci = BusUser::new(Role::Client, "ci").unwrap();
        let creds = minter.mint(&ci, Some(Duration::from_secs(3600))).unwrap();
        let token = http_token(&creds).unwrap();
        assert_eq!(
            token,
            http_token(&creds).unwrap(),
            "the same token every time"
        );
        let verifier = TokenVerifier::of(&launcher).unwrap();
        let bearer = verifier.verify(&token, now()).unwrap();
        assert_eq!(bearer.user, ci);
        let claims = jwt::decode(jwt::jwt_of_creds(creds.text()).unwrap()).unwrap();
        assert_eq!(bearer.key, claims.sub);
        assert_eq!(bearer.issued_at, claims.iat);
        // Expired, a day later.
        assert_eq!(
            verifier.verify(&token, now() + 86_400),
            Err(TokenError::Expired)
        );
    }

    #[test]
    fn forged_tokens_are_refused() {
        let inst = Installation::generate();
        let minter = inst.minter();
        let verifier = TokenVerifier::of(
            &minter
                .mint(&BusUser::new(Role::Launcher, "l").unwrap(), None)
                .unwrap(),
        )
        .unwrap();
        let ci = minter
            .mint(&BusUser::new(Role::Client, "ci").unwrap(), None)
            .unwrap();
        let mallory = minter
            .mint(&BusUser::new(Role::Client, "mallory").unwrap(), None)
            .unwrap();
        // ci's JWT with mallory's signature: the signature is not ci's key's.
        let ci_jwt = jwt::jwt_of_creds(ci.text()).unwrap();
        let mallory_sig = http_token(&mallory)
            .unwrap()
            .rsplit_once('.')
            .unwrap()
            .1
            .to_string();
        assert_eq!(
            verifier.verify(&format!("{ci_jwt}.{mallory_sig}"), now()),
            Err(TokenError::BadSignature)
        );
        // The JWT alone (which the bus sees in every CONNECT) is no token.
        assert!(verifier.verify(ci_jwt, now()).is_err());
        // A credential of another installation.
        let other = Installation::generate()
            .minter()
            .mint(&BusUser::new(Role::Operator, "ci").unwrap(), None)
            .unwrap();
        assert_eq!(
            verifier.verify(&http_token(&other).unwrap(), now()),
            Err(TokenError::NotIssuedHere)
        );
        for junk in ["", "Bearer", "a.b.c.d", "...."] {
            assert!(verifier.verify(junk, now()).is_err(), "{junk:?}");
        }
    }
}
