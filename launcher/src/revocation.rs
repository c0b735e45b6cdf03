//! Revoked credentials: which user keys a launcher refuses (on the HTTP API) and has the
//! NATS server refuse (on the bus).
//!
//! A revocation is a record in KV (`revoked.<user nkey>` in the leases bucket,
//! [`Revocation`]), written by the launcher that decides it: an operator's `revoke`
//! order ([`revoke_user`]), or the deletion of a launched backing node, whose agent's
//! credential goes with it ([`revoke_agent`]). Every launcher holding the installation's
//! revocation keys ([`Desk`]) keeps the server's account equal to KV ([`push`]): it looks
//! at the account JWT the server holds and, when its revocations differ from KV's,
//! pushes one with KV's, issued after the one held (the server keeps the newest, so
//! launchers pushing at once converge on what KV says). The server refuses the revoked
//! credentials from then on and closes their connections at once.

use crate::agent_bus::AgentBus;
use crate::revoked::{follow, Desk, Revoked};
use crate::shared::Shared;
use slotpool_protocol::account_push::AccountPush;
use slotpool_protocol::auth::{jwt, BusUser};
use slotpool_protocol::layout;
use slotpool_protocol::model::Revocation;
use slotpool_protocol::store::KvError;
use slotpool_protocol::{BackingId, PROTOCOL_VERSION};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// How often the server's account is compared with KV even without a change (a server
/// restored from an old resolver directory, say).
const RESYNC: Duration = Duration::from_secs(60);
/// Back-off between attempts to reach the server as the revoker.
const RETRY: Duration = Duration::from_secs(2);
/// How long an operator's `revoke` waits for the server to hold it.
pub const TAKEN_WITHIN: Duration = Duration::from_secs(10);
/// An account JWT this large is said to near the server's `max_payload`.
const JWT_WARN_BYTES: usize = 512 * 1024;
/// Kept past the last credential it covers expired, for clocks apart.
const MARGIN: Duration = Duration::from_secs(3600);

/// Keeps the server's account revocations equal to those in KV until shutdown (see the
/// module's documentation).
pub async fn push(shared: Arc<Shared>, desk: Arc<Desk>) {
    let shutdown = shared.shutdown.clone();
    let wanted = Revoked::default();
    let mut changes = wanted.subscribe();
    shared.tracker.spawn(follow(
        shared.bus.leases.clone(),
        wanted.clone(),
        shutdown.clone(),
    ));
    loop {
        let connected = tokio::select! {
            () = shutdown.cancelled() => return,
            c = AccountPush::connect(&desk.server, desk.revoker.system_user(), desk.revoker.account()) => c,
        };
        let pusher = match connected {
            Ok(p) => p,
            Err(err) => {
                tracing::warn!(%err, "cannot reach the server to push revocations; retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(RETRY) => continue,
                }
            }
        };
        tracing::info!("pushing revoked credentials to the server's account");
        loop {
            if let Err(err) = sync(&pusher, &desk, &wanted.all()).await {
                tracing::warn!(%err, "cannot bring the server's revocations up to date");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(RETRY) => continue,
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = desk.nudge.notified() => {}
                _ = changes.changed() => {}
                () = tokio::time::sleep(RESYNC) => {}
            }
        }
    }
}

/// Pushes the account with `wanted`'s revocations unless the server holds them already;
/// tells the desk what the server holds then.
async fn sync(
    pusher: &AccountPush,
    desk: &Desk,
    wanted: &HashMap<String, u64>,
) -> Result<(), String> {
    let current = pusher.current().await.map_err(|e| e.to_string())?;
    let claims = jwt::decode(&current).map_err(|e| e.to_string())?;
    let held: HashMap<String, u64> = claims.nats["revocations"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_u64()?)))
                .collect()
        })
        .unwrap_or_default();
    if held == *wanted {
        desk.held.send_replace(held);
        return Ok(());
    }
    let issued_at = unix_now().max(claims.iat + 1);
    let sorted: BTreeMap<String, u64> = wanted.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let jwt = desk
        .revoker
        .account_jwt(&sorted, issued_at)
        .map_err(|e| e.to_string())?;
    if jwt.len() > JWT_WARN_BYTES {
        tracing::warn!(
            bytes = jwt.len(),
            revoked = wanted.len(),
            "the account JWT nears the server's max_payload (1 MiB by default); see \
             docs/protocol.md, Revocation"
        );
    }
    pusher.push(&jwt).await.map_err(|e| e.to_string())?;
    tracing::info!(
        revoked = wanted.len(),
        added = wanted.keys().filter(|k| !held.contains_key(*k)).count(),
        dropped = held.keys().filter(|k| !wanted.contains_key(*k)).count(),
        "pushed the account's revocations to the server"
    );
    desk.held.send_replace(wanted.clone());
    Ok(())
}

/// Records the revocation of every credential of `user` issued until now, by `by`; kept
/// for `keep` (none: for good). Returns the user's key and the time.
pub async fn record(
    shared: &Shared,
    user: &BusUser,
    by: &str,
    reason: Option<String>,
    keep: Option<Duration>,
) -> Result<(String, u64), RevokeError> {
    let key = shared.agent_bus.user_key(user).ok_or(RevokeError::NoKeys)?;
    let at = unix_now();
    let record = Revocation {
        v: PROTOCOL_VERSION,
        key: key.clone(),
        user: user.to_string(),
        revoked_at: at,
        by: by.to_string(),
        reason,
    };
    let kv_key = layout::revocation_key(&key);
    let ttl = keep.map(|d| d + MARGIN);
    let store = &shared.bus.leases;
    loop {
        match store.create(&kv_key, &record, ttl).await {
            Ok(_) => break,
            Err(KvError::Conflict { .. }) => match store.get::<Revocation>(&kv_key).await? {
                Some(current) if current.value.revoked_at >= at => break,
                Some(current) => {
                    match store.update(&kv_key, &record, current.revision, ttl).await {
                        Ok(_) => break,
                        Err(KvError::Conflict { .. }) => continue,
                        Err(err) => return Err(err.into()),
                    }
                }
                None => continue,
            },
            Err(err) => return Err(err.into()),
        }
    }
    if let Some(desk) = shared.agent_bus.revocation() {
        desk.nudge.notify_one();
    }
    tracing::info!(user = %user, key, by, "credentials revoked");
    Ok((key, at))
}

/// Revokes the credential of the agent of `backing`, a node whose label retires it at
/// `max_age` (zero: never), as the node is deleted: kept until the last credential minted
/// for it has expired. Nothing without revocation keys.
pub async fn revoke_agent(shared: &Shared, backing: &BackingId, max_age: Duration) {
    if shared.agent_bus.revocation().is_none() {
        return;
    }
    let by = format!("launcher {}", shared.id);
    let keep = AgentBus::lifetime(max_age);
    if let Err(err) = record(
        shared,
        &BusUser::agent(backing),
        &by,
        Some("backing node deleted".into()),
        Some(keep),
    )
    .await
    {
        tracing::warn!(%err, "cannot revoke the deleted node's agent credential");
    }
}

/// Why a revocation could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum RevokeError {
    #[error(
        "this launcher holds no revocation keys: start it with the --agent-signing-key \
         file of a `slotpool nats-setup` that made them"
    )]
    NoKeys,
    #[error(transparent)]
    Kv(#[from] KvError),
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
