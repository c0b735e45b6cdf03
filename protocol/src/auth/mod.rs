//! Who may do what on the bus: slotpool's four roles, the exact subjects each may use,
//! and the NATS credentials (user JWTs) that carry them.
//!
//! Identity is in the subject, never in a payload: a client named `ci` may publish only
//! on `slotpool.api.v2.ci.>`, so a launcher that receives a message there knows `ci`
//! sent it; an operator's orders come on `slotpool.admin.v2.<operator>.<action>`; only
//! the agent of backing node `B` may subscribe to `slotpool.agent.v2.B`, and only
//! launchers may publish there. The server enforces all of it from the JWT each user
//! connects with; [`permissions`] is the one place the rules are written.
//!
//! Trust root ([`Installation`]): an operator key signs two accounts, the system account
//! and slotpool's own (JetStream on); slotpool's account has one signing key, held by
//! launchers as a [`Minter`], which signs user JWTs: the setup command's fixed users and,
//! at each launch, one agent credential per backing node with an expiry.
//!
//! Revocation ([`Revoker`]): the server resolves accounts with NATS's full resolver, which
//! takes a newer account JWT at run time. Launchers hold an operator signing key and a
//! system user allowed to push (and look up) slotpool's account alone; they push the
//! account with its `revocations` (user nkey → time: credentials of that key issued until
//! then are refused, and the server closes their connections at once). Every credential
//! of one user has the same nkey ([`Minter::user_key`]), so one revocation covers them
//! all.

pub mod http_token;
pub mod jwt;
pub mod setup;

use crate::ids::{BackingId, UserName};
use crate::layout::{self, subjects, ALL_BUCKETS};
use nkeys::KeyPair;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Why a credential could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("encoding a JWT: {0}")]
    Encode(String),
    #[error("malformed JWT: {0}")]
    BadJwt(String),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not slotpool credentials: {message}")]
    NotSlotpool { path: PathBuf, message: String },
}

/// The four kinds of bus users.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs `slotpool serve`: everything.
    Launcher,
    /// Orders hold, drain, run, kill and release of any node; reads every bucket.
    Operator,
    /// Submits, releases and cancels its own requests; reads nothing else.
    Client,
    /// One backing node's agent: its own command subject, heartbeat key and slot keys
    /// (read only) only.
    Agent,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Launcher, Role::Operator, Role::Client, Role::Agent];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Launcher => "launcher",
            Role::Operator => "operator",
            Role::Client => "client",
            Role::Agent => "agent",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One user of the bus: a role and a name (for an agent, its backing id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusUser {
    pub role: Role,
    pub name: UserName,
}

impl BusUser {
    pub fn new(role: Role, name: &str) -> Result<BusUser, crate::ids::InvalidId> {
        Ok(BusUser {
            role,
            name: UserName::parse(name)?,
        })
    }

    /// The agent of backing node `backing`.
    pub fn agent(backing: &BackingId) -> BusUser {
        BusUser {
            role: Role::Agent,
            name: UserName::parse(backing.as_str()).expect("a backing id is a name token"),
        }
    }

    /// The prefix of this user's reply subjects (`_INBOX.<role>.<name>`): a user may
    /// subscribe to its own replies only, never to another's.
    pub fn inbox_prefix(&self) -> String {
        format!("_INBOX.{}.{}", self.role, self.name)
    }

    /// The JWT tag that says which role a credential is for.
    fn tag(&self) -> String {
        format!("slotpool-role:{}", self.role)
    }
}

impl fmt::Display for BusUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.role, self.name)
    }
}

/// What a user may publish and subscribe to.
#[derive(Clone, Debug, PartialEq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
    /// May answer a request it received (one reply each), whatever its reply subject.
    pub responses: bool,
}

/// The subjects `user` may use: the one statement of slotpool's authorisation.
pub fn permissions(user: &BusUser) -> Permissions {
    let name = user.name.as_str();
    let inbox = format!("{}.>", user.inbox_prefix());
    // Every slotpool connection opens the six buckets (stream info, no contents).
    let mut open_buckets = vec![subjects::JETSTREAM_INFO.to_string()];
    open_buckets.extend(
        ALL_BUCKETS
            .iter()
            .map(|b| format!("$JS.API.STREAM.INFO.KV_{}", b.name)),
    );
    match user.role {
        Role::Launcher => Permissions {
            publish: vec![">".into()],
            subscribe: vec![">".into()],
            responses: false,
        },
        Role::Client => {
            let mut publish = vec![
                subjects::api_of(name),
                subjects::exec_input_of(name),
                subjects::API_V1_ALL.into(),
            ];
            publish.extend(open_buckets);
            Permissions {
                publish,
                subscribe: vec![inbox],
                responses: false,
            }
        }
        Role::Operator => {
            let mut publish = vec![
                subjects::api_of(name),
                subjects::admin_of(name),
                subjects::exec_input_of(name),
                subjects::API_V1_ALL.into(),
                subjects::ADMIN_V1_ALL.into(),
            ];
            publish.extend(open_buckets);
            // Reads of every bucket: gets, watches (a consumer, its info and flow
            // control). The token after each prefix is the stream, so a wildcard there
            // stands for every stream of slotpool's account, which are its buckets and
            // nothing else: only launchers may create streams, and they create only
            // `ALL_BUCKETS`. One line per kind of read instead of one per bucket keeps
            // the JWT, and so the CONNECT line, far below the server's 4 KiB limit
            // (`max_control_line`); naming each bucket took 3.9 KiB for an operator
            // named `alice`, and a long name went over it. `X.>` is exactly `X.*` (the
            // stream alone) and `X.*.>` (the stream and what follows).
            publish.extend(
                [
                    "$JS.API.DIRECT.GET.>",
                    "$JS.API.STREAM.MSG.GET.*",
                    "$JS.API.CONSUMER.CREATE.>",
                    "$JS.API.CONSUMER.INFO.*.>",
                    "$JS.FC.*.>",
                ]
                .map(String::from),
            );
            Permissions {
                publish,
                subscribe: vec![inbox],
                responses: false,
            }
        }
        Role::Agent => {
            let mut publish = vec![format!("$KV.{}.{name}", layout::AGENTS.name)];
            publish.extend(open_buckets);
            // Reads the slots bucket's keys of its own backing node, and no others: a
            // restarted agent releases the slots whose node is gone. A KV get is a
            // direct get of the key's last message, the key in the subject (async-nats
            // does so on every bucket slotpool makes: they allow direct gets).
            publish.push(format!(
                "$JS.API.DIRECT.GET.KV_{slots}.$KV.{slots}.{name}.>",
                slots = layout::SLOTS.name
            ));
            // Commands it runs for clients (see `crate::exec`): their input comes from
            // each client's own subject and to this node only; output goes to the exec
            // inboxes, which only the command's owner may read, and only into sessions
            // that name this node, so no agent can speak in another node's sessions.
            publish.push(subjects::exec_output_from(name));
            Permissions {
                publish,
                subscribe: vec![
                    subjects::agent_of(name),
                    subjects::exec_input_to(name),
                    inbox,
                ],
                responses: true,
            }
        }
    }
}

/// A `.creds` file's text: a user JWT and its seed. Secret: never printed, logged or put
/// on a command line; written only with [`Credentials::write_private`].
#[derive(Clone, PartialEq)]
pub struct Credentials(String);

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credentials(<redacted>)")
    }
}

impl Credentials {
    pub fn from_text(text: String) -> Credentials {
        Credentials(text)
    }

    pub fn text(&self) -> &str {
        &self.0
    }

    /// When these credentials expire (seconds since the epoch), if they do.
    pub fn expires_at(&self) -> Result<Option<u64>, AuthError> {
        let jwt = jwt::jwt_of_creds(&self.0)
            .ok_or_else(|| AuthError::BadJwt("no user JWT in the credentials".into()))?;
        Ok(jwt::decode(jwt)?.exp)
    }

    /// Writes the credentials to `path`, readable by its owner only (created 0600, never
    /// readable by others even for a moment; an existing file is replaced).
    pub fn write_private(&self, path: &Path) -> Result<(), AuthError> {
        write_private(path, self.0.as_bytes())
    }
}

/// Writes `bytes` to `path` with mode 0600 from the start (via a temp file in the same
/// directory, renamed over the target).
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), AuthError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| AuthError::Io {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// The bus user a credentials file is for, from the JWT in it (its `name` and role
/// tag). Used by clients to pick their subjects and inbox; the server checks the
/// signature, this only reads.
pub fn read_user(path: &Path) -> Result<BusUser, AuthError> {
    let text = std::fs::read_to_string(path).map_err(|source| AuthError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let not = |message: String| AuthError::NotSlotpool {
        path: path.to_path_buf(),
        message,
    };
    let jwt = jwt::jwt_of_creds(&text).ok_or_else(|| not("no user JWT in it".into()))?;
    let claims = jwt::decode(jwt).map_err(|e| not(e.to_string()))?;
    http_token::user_of(&claims).ok_or_else(|| {
        not(format!(
            "its JWT has no slotpool-role tag or its name {:?} is not a name token (made by \
             `slotpool nats-setup`?)",
            claims.name
        ))
    })
}

/// A copy of a key pair made from a seed.
fn copy(key: &KeyPair) -> KeyPair {
    KeyPair::from_seed(&key.seed().expect("a generated key has a seed")).expect("a seed read back")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What a launcher holds to mint user credentials: slotpool's account public key and
/// the account's signing key. Secret.
pub struct Minter {
    account: String,
    signing: KeyPair,
}

/// The on-disk form of a [`Minter`] and, when the installation has them, its
/// [`Revoker`]'s keys (`agent-signing.json`, mode 0600).
#[derive(Serialize, Deserialize)]
struct MinterFile {
    account: String,
    signing_seed: String,
    /// Made by `slotpool nats-setup` since credentials can be revoked; absent in an
    /// older installation's file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    revocation: Option<RevocationFile>,
}

#[derive(Clone, Serialize, Deserialize)]
struct RevocationFile {
    /// The operator's signing key, which signs slotpool's account JWT.
    operator_signing_seed: String,
    /// A system-account user that may push and look up slotpool's account only.
    system_user_creds: String,
}

impl Minter {
    /// Reads a signing key file written by `slotpool nats-setup`.
    pub fn load(path: &Path) -> Result<Minter, AuthError> {
        let file = read_key_file(path)?;
        let bad = |message: String| AuthError::File {
            path: path.to_path_buf(),
            message,
        };
        let signing = KeyPair::from_seed(&file.signing_seed)
            .map_err(|e| bad(format!("signing_seed: {e}")))?;
        if !file.account.starts_with('A') || KeyPair::from_public_key(&file.account).is_err() {
            return Err(bad(format!(
                "account {:?} is not an account public key",
                file.account
            )));
        }
        Ok(Minter {
            account: file.account,
            signing,
        })
    }

    /// Writes this minter's file (mode 0600), with `revocation`'s keys if given.
    pub fn save(&self, path: &Path, revocation: Option<&Revoker>) -> Result<(), AuthError> {
        let seed = |k: &KeyPair| k.seed().map_err(|e| AuthError::Encode(e.to_string()));
        let file = MinterFile {
            account: self.account.clone(),
            signing_seed: seed(&self.signing)?,
            revocation: match revocation {
                Some(r) => Some(RevocationFile {
                    operator_signing_seed: seed(&r.operator_signing)?,
                    system_user_creds: r.system_user.text().to_string(),
                }),
                None => None,
            },
        };
        let json = serde_json::to_vec_pretty(&file).expect("plain data");
        write_private(path, &json)
    }

    /// The account this minter's users belong to.
    pub fn account(&self) -> &str {
        &self.account
    }

    /// The nkey every credential of `user` minted here has (see [`Minter::mint`]): what
    /// a revocation of `user` names.
    pub fn user_key(&self, user: &BusUser) -> String {
        self.user_key_pair(user).public_key()
    }

    /// The key pair of `user`'s credentials: derived from the signing key, the role and
    /// the name, so that every credential of one user has the same nkey and revoking it
    /// (a revocation of that key at a time) revokes every credential of the user issued
    /// until then, whoever minted it, while one minted later is valid.
    fn user_key_pair(&self, user: &BusUser) -> KeyPair {
        use sha2::{Digest, Sha256};
        let (_, signing) = nkeys::decode_seed(
            &self
                .signing
                .seed()
                .expect("a signing key made from a seed has one"),
        )
        .expect("a seed of our own decodes");
        let mut hash = Sha256::new();
        hash.update(b"slotpool user nkey v1\0");
        hash.update(signing);
        hash.update(b"\0");
        hash.update(user.role.as_str().as_bytes());
        hash.update(b"\0");
        hash.update(user.name.as_str().as_bytes());
        KeyPair::new_from_raw(nkeys::KeyPairType::User, hash.finalize().into())
            .expect("32 bytes make a key")
    }

    /// A credential for `user`, valid for `valid_for` (none: until revoked).
    pub fn mint(
        &self,
        user: &BusUser,
        valid_for: Option<Duration>,
    ) -> Result<Credentials, AuthError> {
        let key = self.user_key_pair(user);
        let perms = permissions(user);
        let now = unix_now();
        let claims = jwt::Claims {
            exp: valid_for.map(|d| now + d.as_secs().max(1)),
            jti: String::new(),
            iat: now,
            iss: String::new(),
            name: user.name.to_string(),
            sub: key.public_key(),
            nats: jwt::user_nats(
                &self.account,
                &perms.publish,
                &perms.subscribe,
                perms.responses,
                &[user.tag()],
            ),
        };
        let token = jwt::encode(claims, &self.signing)?;
        let seed = key.seed().map_err(|e| AuthError::Encode(e.to_string()))?;
        Ok(Credentials(jwt::creds_file(&token, &seed)))
    }
}

/// Reads a key file written by `slotpool nats-setup` ([`Minter::save`]).
fn read_key_file(path: &Path) -> Result<MinterFile, AuthError> {
    let text = std::fs::read_to_string(path).map_err(|source| AuthError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| AuthError::File {
        path: path.to_path_buf(),
        message: format!(
            "not a slotpool signing key file ({e}); expected {{\"account\", \"signing_seed\"}}"
        ),
    })
}

/// What a launcher holds to revoke credentials: it signs slotpool's account JWT with its
/// revocations, and pushes it as a system user that may push and look up that account
/// only. Secret, like the [`Minter`] it comes with.
pub struct Revoker {
    account: String,
    /// The account's signing key (public): the account JWT lists it.
    signing: String,
    operator_signing: KeyPair,
    system_user: Credentials,
}

impl Revoker {
    /// The revocation keys of the key file at `path`, if it has any (files made before
    /// credentials could be revoked have none).
    pub fn load(path: &Path) -> Result<Option<Revoker>, AuthError> {
        let file = read_key_file(path)?;
        let Some(revocation) = file.revocation else {
            return Ok(None);
        };
        let bad = |message: String| AuthError::File {
            path: path.to_path_buf(),
            message,
        };
        let signing = KeyPair::from_seed(&file.signing_seed)
            .map_err(|e| bad(format!("signing_seed: {e}")))?;
        let operator_signing = KeyPair::from_seed(&revocation.operator_signing_seed)
            .map_err(|e| bad(format!("operator_signing_seed: {e}")))?;
        Ok(Some(Revoker {
            account: file.account,
            signing: signing.public_key(),
            operator_signing,
            system_user: Credentials(revocation.system_user_creds),
        }))
    }

    /// slotpool's account.
    pub fn account(&self) -> &str {
        &self.account
    }

    /// The credentials of the system user that pushes the account.
    pub fn system_user(&self) -> &Credentials {
        &self.system_user
    }

    /// slotpool's account JWT with `revocations` (user nkey → revoked at, seconds since
    /// the epoch), issued at `issued_at`: the server keeps the account JWT issued last.
    pub fn account_jwt(
        &self,
        revocations: &std::collections::BTreeMap<String, u64>,
        issued_at: u64,
    ) -> Result<String, AuthError> {
        let mut nats = jwt::account_nats(std::slice::from_ref(&self.signing));
        if !revocations.is_empty() {
            nats["revocations"] = serde_json::json!(revocations);
        }
        jwt::encode(
            jwt::Claims {
                exp: None,
                jti: String::new(),
                iat: issued_at,
                iss: String::new(),
                name: ACCOUNT_NAME.into(),
                sub: self.account.clone(),
                nats,
            },
            &self.operator_signing,
        )
    }
}

/// The name of slotpool's account in its JWT.
const ACCOUNT_NAME: &str = "slotpool";

/// An installation's trust root: the operator and its signing key, the system account,
/// slotpool's account and its signing key. Made once by `slotpool nats-setup`; the server
/// loads the JWTs ([`Installation::server_config`]), launchers the [`Minter`] and the
/// [`Revoker`].
pub struct Installation {
    operator: KeyPair,
    operator_signing: KeyPair,
    system: KeyPair,
    account: KeyPair,
    signing: KeyPair,
}

impl Installation {
    pub fn generate() -> Installation {
        Installation {
            operator: KeyPair::new_operator(),
            operator_signing: KeyPair::new_operator(),
            system: KeyPair::new_account(),
            account: KeyPair::new_account(),
            signing: KeyPair::new_account(),
        }
    }

    pub fn minter(&self) -> Minter {
        Minter {
            account: self.account.public_key(),
            signing: copy(&self.signing),
        }
    }

    /// The revocation keys launchers hold: the operator signing key and a system user
    /// allowed to push and look up slotpool's account, and nothing else.
    pub fn revoker(&self) -> Result<Revoker, AuthError> {
        let account = self.account.public_key();
        let key = KeyPair::new_user();
        let publish = vec![
            subjects::claims_update(&account),
            subjects::claims_lookup(&account),
        ];
        let nats = serde_json::json!({
            "pub": { "allow": publish },
            "sub": { "allow": [format!("{}.>", subjects::REVOKER_INBOX)] },
            "subs": -1, "data": -1, "payload": -1,
            "type": "user",
            "version": 2
        });
        let token = jwt::encode(
            jwt::Claims {
                exp: None,
                jti: String::new(),
                iat: unix_now(),
                iss: String::new(),
                name: "slotpool-revoker".into(),
                sub: key.public_key(),
                nats,
            },
            &self.system,
        )?;
        let seed = key.seed().map_err(|e| AuthError::Encode(e.to_string()))?;
        Ok(Revoker {
            account,
            signing: self.signing.public_key(),
            operator_signing: copy(&self.operator_signing),
            system_user: Credentials(jwt::creds_file(&token, &seed)),
        })
    }

    fn signed(
        &self,
        name: &str,
        subject: &KeyPair,
        nats: serde_json::Value,
        signer: &KeyPair,
    ) -> Result<String, AuthError> {
        jwt::encode(
            jwt::Claims {
                exp: None,
                jti: String::new(),
                iat: unix_now(),
                iss: String::new(),
                name: name.into(),
                sub: subject.public_key(),
                nats,
            },
            signer,
        )
    }

    /// The nats-server configuration lines that trust this installation: the operator,
    /// the system account and slotpool's account, preloaded into a full resolver that
    /// keeps accounts pushed later in `resolver_dir`. Add `listen`, `jetstream` and `tls`
    /// around them.
    pub fn server_config(&self, resolver_dir: &Path) -> Result<String, AuthError> {
        let operator = self.signed(
            "slotpool",
            &self.operator,
            jwt::operator_nats(
                &self.system.public_key(),
                &[self.operator_signing.public_key()],
            ),
            &self.operator,
        )?;
        let system = self.signed(
            "SYS",
            &self.system,
            jwt::system_account_nats(),
            &self.operator,
        )?;
        let account = self.signed(
            ACCOUNT_NAME,
            &self.account,
            jwt::account_nats(&[self.signing.public_key()]),
            &self.operator,
        )?;
        Ok(format!(
            "# slotpool: decentralised authentication (operator, accounts, user JWTs).\n\
             # Users need credentials minted with this installation's signing key.\n\
             operator: {operator}\n\
             system_account: {sys}\n\
             # Launchers push slotpool's account with its revocations; the server keeps\n\
             # the newest in this directory (writable by the server).\n\
             resolver: {{\n  type: full\n  dir: \"{dir}\"\n  allow_delete: false\n  \
             interval: \"2m\"\n  timeout: \"5s\"\n}}\n\
             resolver_preload: {{\n  {sys}: {system}\n  {acc}: {account}\n}}\n",
            sys = self.system.public_key(),
            acc = self.account.public_key(),
            dir = resolver_dir.display(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(role: Role, name: &str) -> BusUser {
        BusUser::new(role, name).unwrap()
    }

    #[test]
    fn a_client_publishes_only_under_its_own_name() {
        let p = permissions(&user(Role::Client, "ci"));
        assert!(p.publish.contains(&"slotpool.api.v2.ci.>".to_string()));
        // Input to its own commands only: the subject carries its name.
        assert!(p.publish.contains(&"slotpool.exec.v2.ci.>".to_string()));
        assert!(!p
            .publish
            .iter()
            .any(|s| s.starts_with("slotpool.exec") && !s.starts_with("slotpool.exec.v2.ci.")));
        assert!(!p.publish.iter().any(|s| s.starts_with("slotpool.admin")
            || s.starts_with("slotpool.agent")
            || s.starts_with("$KV")
            || s.contains("DIRECT.GET")
            || s.contains("CONSUMER")
            || s.contains("DELETE")
            || s == ">"));
        assert_eq!(p.subscribe, vec!["_INBOX.client.ci.>".to_string()]);
        assert!(!p.responses);
    }

    #[test]
    fn an_agent_hears_only_its_own_commands_and_writes_only_its_heartbeat() {
        let b = BackingId::parse("bn-abc").unwrap();
        let p = permissions(&BusUser::agent(&b));
        assert_eq!(
            p.subscribe,
            vec![
                "slotpool.agent.v2.bn-abc".to_string(),
                "slotpool.exec.v2.*.bn-abc.>".to_string(),
                "_INBOX.agent.bn-abc.>".to_string()
            ]
        );
        let writes: Vec<_> = p
            .publish
            .iter()
            .filter(|s| !s.starts_with("$JS.API"))
            .collect();
        // Its heartbeat, and the output of commands it runs to their callers' exec
        // inboxes (never to a caller's replies: `_INBOX.client.ci.x` is not covered),
        // in sessions on its own node only.
        assert_eq!(
            writes,
            vec!["$KV.slotpool_agents.bn-abc", "_INBOX.*.*.exec.*.bn-abc.>"]
        );
        assert!(!writes.iter().any(|w| matches(w, "_INBOX.client.ci.reply1")));
        let output = |backing: &str| {
            let backing = BackingId::parse(backing).unwrap();
            format!(
                "{}.stdout",
                subjects::exec_output("_INBOX.client.ci", "s1", &backing)
            )
        };
        assert!(writes.iter().any(|w| matches(w, &output("bn-abc"))));
        assert!(writes
            .iter()
            .any(|w| matches(w, "_INBOX.operator.alice.exec.s1.bn-abc.exit")));
        assert!(!writes.iter().any(|w| matches(w, &output("bn-other"))));
        assert!(!writes
            .iter()
            .any(|w| matches(w, "_INBOX.client.ci.exec.s1.stdout")));
        assert!(p.responses);
    }

    /// Whether the server lets `pattern` (a permission) cover `subject`.
    fn matches(pattern: &str, subject: &str) -> bool {
        let (p, s): (Vec<_>, Vec<_>) = (pattern.split('.').collect(), subject.split('.').collect());
        p.iter().enumerate().all(|(i, t)| match *t {
            ">" => s.len() > i,
            "*" => i < s.len(),
            t => s.get(i) == Some(&t),
        }) && (p.last() == Some(&">") || p.len() == s.len())
    }

    #[test]
    fn an_operator_reads_every_bucket_and_writes_none() {
        let p = permissions(&user(Role::Operator, "alice"));
        let may = |subject: &str| p.publish.iter().any(|pat| matches(pat, subject));
        for b in ALL_BUCKETS {
            let (stream, kv) = (format!("KV_{}", b.name), format!("$KV.{}", b.name));
            for read in [
                format!("$JS.API.STREAM.INFO.{stream}"),
                format!("$JS.API.DIRECT.GET.{stream}"),
                format!("$JS.API.DIRECT.GET.{stream}.{kv}.some-key"),
                format!("$JS.API.STREAM.MSG.GET.{stream}"),
                format!("$JS.API.CONSUMER.CREATE.{stream}"),
                format!("$JS.API.CONSUMER.CREATE.{stream}.c1.{kv}.>"),
                format!("$JS.API.CONSUMER.INFO.{stream}.c1"),
                format!("$JS.FC.{stream}.abc.1"),
            ] {
                assert!(may(&read), "the operator may not read with {read}");
            }
            for write in [
                format!("{kv}.some-key"),
                format!("$JS.API.STREAM.DELETE.{stream}"),
                format!("$JS.API.STREAM.PURGE.{stream}"),
                format!("$JS.API.STREAM.UPDATE.{stream}"),
                format!("$JS.API.STREAM.CREATE.{stream}"),
                format!("$JS.API.STREAM.MSG.DELETE.{stream}"),
                format!("$JS.API.CONSUMER.DELETE.{stream}.c1"),
                format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.c1"),
            ] {
                assert!(!may(&write), "the operator may write with {write}");
            }
        }
        for other in [
            "slotpool.admin.v2.bob.kill",
            "slotpool.api.v2.ci.submit",
            "slotpool.agent.v2.bn-1",
            "$JS.API.STREAM.CREATE.KV_mine",
            "$JS.API.ACCOUNT.PURGE",
        ] {
            assert!(!may(other), "the operator may publish on {other}");
        }
        assert!(may("slotpool.admin.v2.alice.kill"));
    }

    #[test]
    fn an_agent_reads_its_own_slot_keys_and_no_other_key() {
        let p = permissions(&BusUser::agent(&BackingId::parse("bn-abc").unwrap()));
        let reads: Vec<_> = p
            .publish
            .iter()
            .filter(|s| s.contains("DIRECT.GET") || s.contains("MSG.GET"))
            .collect();
        assert_eq!(
            reads,
            vec!["$JS.API.DIRECT.GET.KV_slotpool_slots.$KV.slotpool_slots.bn-abc.>"]
        );
        // What the server matches a read of another backing node's key, or of any other
        // bucket, against: none of the agent's subjects covers it.
        let own = "$JS.API.DIRECT.GET.KV_slotpool_slots.$KV.slotpool_slots.bn-abc.3";
        assert!(p.publish.iter().any(|pat| matches(pat, own)));
        for other in [
            "$JS.API.DIRECT.GET.KV_slotpool_slots.$KV.slotpool_slots.bn-abcd.3",
            "$JS.API.DIRECT.GET.KV_slotpool_slots.$KV.slotpool_slots.bn-other.0",
            "$JS.API.DIRECT.GET.KV_slotpool_slots",
            "$JS.API.STREAM.MSG.GET.KV_slotpool_slots",
            "$JS.API.DIRECT.GET.KV_slotpool_requests.$KV.slotpool_requests.bn-abc.>",
            "$JS.API.CONSUMER.CREATE.KV_slotpool_slots",
            "$KV.slotpool_slots.bn-abc.3",
        ] {
            assert!(
                !p.publish.iter().any(|pat| matches(pat, other)),
                "the agent may publish on {other}"
            );
        }
    }

    #[test]
    fn operators_order_under_their_own_name_and_delete_nothing() {
        let p = permissions(&user(Role::Operator, "alice"));
        assert!(p.publish.contains(&"slotpool.admin.v2.alice.>".to_string()));
        assert!(!p.publish.iter().any(|s| s.contains("DELETE")
            || s.contains("PURGE")
            || s.starts_with("$KV")
            || s.contains("slotpool.admin.v2.*")
            || s == ">"));
    }

    #[test]
    fn minted_credentials_say_who_they_are_for() {
        let inst = Installation::generate();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ci.creds");
        let creds = inst
            .minter()
            .mint(&user(Role::Client, "ci"), Some(Duration::from_secs(60)))
            .unwrap();
        creds.write_private(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read_user(&path).unwrap(), user(Role::Client, "ci"));
        assert!(format!("{creds:?}").contains("redacted"));
        let claims = jwt::decode(jwt::jwt_of_creds(creds.text()).unwrap()).unwrap();
        assert!(claims.exp.is_some());
    }

    #[test]
    fn every_credential_of_a_user_has_the_users_key_and_no_other_user_has_it() {
        let minter = Installation::generate().minter();
        let sub = |role, name| {
            let creds = minter
                .mint(&user(role, name), Some(Duration::from_secs(60)))
                .unwrap();
            jwt::decode(jwt::jwt_of_creds(creds.text()).unwrap())
                .unwrap()
                .sub
        };
        let ci = sub(Role::Client, "ci");
        assert_eq!(ci, sub(Role::Client, "ci"));
        assert_eq!(ci, minter.user_key(&user(Role::Client, "ci")));
        assert!(ci.starts_with('U'));
        assert_ne!(ci, sub(Role::Client, "cd"));
        assert_ne!(ci, sub(Role::Operator, "ci"));
        // Another installation's ci is another key.
        let other = Installation::generate().minter();
        assert_ne!(ci, other.user_key(&user(Role::Client, "ci")));
    }

    #[test]
    fn each_revocation_costs_the_account_jwt_what_docs_protocol_md_says() {
        let inst = Installation::generate();
        let revoker = inst.revoker().unwrap();
        let minter = inst.minter();
        let none = revoker
            .account_jwt(&Default::default(), 1_800_000_000)
            .unwrap();
        let many: std::collections::BTreeMap<String, u64> = (0..100)
            .map(|i| {
                let key = minter.user_key(&BusUser::agent(
                    &BackingId::parse(&format!("bn-{i:06}")).unwrap(),
                ));
                (key, 1_800_000_000 + i)
            })
            .collect();
        let with = revoker.account_jwt(&many, 1_800_000_000).unwrap();
        let per = (with.len() - none.len()) / 100;
        let doc = include_str!("../../../docs/protocol.md");
        assert!(
            doc.contains(&format!("about {per} bytes per revocation kept")),
            "docs/protocol.md should say about {per} bytes per revocation"
        );
    }

    #[test]
    fn a_minter_survives_its_file() {
        let inst = Installation::generate();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("signing.json");
        inst.minter().save(&path, None).unwrap();
        let back = Minter::load(&path).unwrap();
        assert_eq!(back.account, inst.account.public_key());
        std::fs::write(&path, "{}").unwrap();
        let err = Minter::load(&path).err().unwrap().to_string();
        assert!(err.contains("signing key file"), "{err}");
    }
}
