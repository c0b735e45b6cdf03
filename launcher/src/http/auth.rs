//! Who may read what over `slotpool serve --http`: the bus's authorisation, carried over.
//!
//! A caller shows `Authorization: Bearer TOKEN`. A token derived from a bus credential
//! (`slotpool http-token`, [`slotpool_protocol::auth::http_token`]) makes the caller
//! that bus user: a client sees and streams only its own requests and nodes (the ones
//! whose `client` is its name), as on the bus; an operator or a launcher sees
//! everything; an agent nothing. The static `--http-token-file` token (for Prometheus)
//! and a client certificate (`--http-client-ca`) see everything. A revoked credential's
//! token is refused as the bus refuses the credential.
//!
//! A token is needed on loopback too: the launcher's host may run slots, whose jobs
//! reach its loopback. `--http-no-auth` drops the check (everyone sees everything),
//! logged loudly at start.

use crate::revoked::Revoked;
use slotpool_protocol::auth::http_token::{TokenError, TokenVerifier};
use slotpool_protocol::auth::Role;
use slotpool_protocol::bearer::BearerToken;
use slotpool_protocol::UserName;

/// Who is asking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// Sees everything: an operator, a launcher, the static token, a client certificate,
    /// anyone with `--http-no-auth`.
    Everything,
    /// Sees its own requests and nodes only.
    Client(UserName),
}

impl Caller {
    /// Whether this caller may see a record whose `client` is `owner`.
    pub fn sees(&self, owner: Option<&UserName>) -> bool {
        match self {
            Caller::Everything => true,
            Caller::Client(name) => owner == Some(name),
        }
    }
}

/// Why a request is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denied {
    /// No token, or one that is not valid: 401.
    Unauthorized(String),
    /// A valid token of a user who may not read this: 403.
    Forbidden(String),
}

/// How callers are authorised.
#[derive(Clone)]
pub struct HttpAuth {
    /// `--http-no-auth`: everyone sees everything.
    pub open: bool,
    /// `--http-token-file`: a token that sees everything.
    pub static_token: Option<BearerToken>,
    /// Checks tokens derived from bus credentials (none on an anonymous bus).
    pub verifier: Option<TokenVerifier>,
    /// Every client shows a certificate of `--http-client-ca`.
    pub client_certificates: bool,
    /// Revoked credentials, whose tokens are refused.
    pub revoked: Revoked,
}

impl HttpAuth {
    /// Who sent `authorization` (the header's value), at `now` (seconds since the epoch).
    pub fn caller(&self, authorization: Option<&str>, now: u64) -> Result<Caller, Denied> {
        if self.open {
            return Ok(Caller::Everything);
        }
        let Some(token) = authorization.and_then(|v| v.strip_prefix("Bearer ")) else {
            if self.client_certificates {
                return Ok(Caller::Everything);
            }
            return Err(Denied::Unauthorized("bearer token required".into()));
        };
        if self
            .static_token
            .as_ref()
            .is_some_and(|t| t.accepts(authorization))
        {
            return Ok(Caller::Everything);
        }
        let Some(verifier) = &self.verifier else {
            return Err(Denied::Unauthorized("the bearer token is not valid".into()));
        };
        let bearer = verifier.verify(token, now).map_err(|err| {
            Denied::Unauthorized(match err {
                // The static token, mistyped, would land here: say what is accepted.
                TokenError::Malformed(_) => {
                    "the bearer token is not valid (neither --http-token-file's nor one of \
                     `slotpool http-token`)"
                        .to_string()
                }
                err => err.to_string(),
            })
        })?;
        if self.revoked.covers(&bearer.key, bearer.issued_at) {
            return Err(Denied::Unauthorized(format!(
                "the credential of {} was revoked",
                bearer.user
            )));
        }
        match bearer.user.role {
            Role::Operator | Role::Launcher => Ok(Caller::Everything),
            Role::Client => Ok(Caller::Client(bearer.user.name)),
            Role::Agent => Err(Denied::Forbidden(format!(
                "{} may not read the HTTP API",
                bearer.user
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slotpool_protocol::auth::http_token::http_token;
    use slotpool_protocol::auth::{BusUser, Installation, Minter};

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    fn token(minter: &Minter, role: Role, name: &str) -> String {
        let creds = minter
            .mint(&BusUser::new(role, name).unwrap(), None)
            .unwrap();
        format!("Bearer {}", http_token(&creds).unwrap())
    }

    fn auth(minter: &Minter) -> HttpAuth {
        let launcher = minter
            .mint(&BusUser::new(Role::Launcher, "l").unwrap(), None)
            .unwrap();
        HttpAuth {
            open: false,
            static_token: None,
            verifier: Some(TokenVerifier::of(&launcher).unwrap()),
            client_certificates: false,
            revoked: Revoked::default(),
        }
    }

    #[test]
    fn each_role_sees_what_it_sees_on_the_bus() {
        let minter = Installation::generate().minter();
        let auth = auth(&minter);
        let caller = |h: &str| auth.caller(Some(h), now());
        assert_eq!(
            caller(&token(&minter, Role::Client, "ci")),
            Ok(Caller::Client(UserName::parse("ci").unwrap()))
        );
        assert_eq!(
            caller(&token(&minter, Role::Operator, "alice")),
            Ok(Caller::Everything)
        );
        assert!(matches!(
            caller(&token(&minter, Role::Agent, "bn-1")),
            Err(Denied::Forbidden(_))
        ));
        assert!(matches!(
            auth.caller(None, now()),
            Err(Denied::Unauthorized(_))
        ));
        assert!(matches!(
            caller("Bearer nonsense"),
            Err(Denied::Unauthorized(_))
        ));
        let ci = Caller::Client(UserName::parse("ci").unwrap());
        assert!(ci.sees(Some(&UserName::parse("ci").unwrap())));
        assert!(!ci.sees(Some(&UserName::parse("other").unwrap())));
        assert!(!ci.sees(None));
    }

    #[test]
    fn a_revoked_credentials_token_is_refused() {
        let minter = Installation::generate().minter();
        let auth = auth(&minter);
        let ci = token(&minter, Role::Client, "ci");
        assert!(auth.caller(Some(&ci), now()).is_ok());
        let key = minter.user_key(&BusUser::new(Role::Client, "ci").unwrap());
        auth.revoked.insert(key, now());
        let refused = auth.caller(Some(&ci), now());
        assert!(
            matches!(&refused, Err(Denied::Unauthorized(why)) if why.contains("revoked")),
            "{refused:?}"
        );
        // Another client is not touched.
        assert!(auth
            .caller(Some(&token(&minter, Role::Client, "cd")), now())
            .is_ok());
    }

    #[test]
    fn without_tokens_only_the_open_listener_or_certificates_let_callers_in() {
        let open = HttpAuth {
            open: true,
            static_token: None,
            verifier: None,
            client_certificates: false,
            revoked: Revoked::default(),
        };
        assert_eq!(open.caller(None, now()), Ok(Caller::Everything));
        let certs = HttpAuth {
            open: false,
            client_certificates: true,
            ..open.clone()
        };
        assert_eq!(certs.caller(None, now()), Ok(Caller::Everything));
        let closed = HttpAuth {
            client_certificates: false,
            ..certs
        };
        assert!(closed.caller(None, now()).is_err());
    }
}
