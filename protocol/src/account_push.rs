//! Pushing slotpool's account JWT to the NATS server (its full resolver) and reading back
//! the one it holds, as the system user of a [`crate::auth::Revoker`]: how revocations
//! reach the server. The only use of the system account.

use crate::auth::Credentials;
use crate::connect::{BusError, NatsOptions};
use crate::layout::subjects;
use std::time::Duration;

/// How long the server has to answer a push or a look-up.
const ANSWER: Duration = Duration::from_secs(5);

/// A connection as the system user that may push and look up slotpool's account.
pub struct AccountPush {
    client: async_nats::Client,
    account: String,
}

impl AccountPush {
    /// Connects to the server of `opts` (its URL and TLS; not its credentials) as the
    /// system user `creds`, for `account`.
    pub async fn connect(
        opts: &NatsOptions,
        creds: &Credentials,
        account: &str,
    ) -> Result<AccountPush, BusError> {
        let connect_error = |message: String| BusError::Connect {
            url: opts.url.clone(),
            message,
        };
        let o = async_nats::ConnectOptions::new()
            .custom_inbox_prefix(subjects::REVOKER_INBOX)
            .name("slotpool-revoker")
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None::<usize>)
            .credentials(creds.text())
            .map_err(|e| connect_error(format!("the revoker's credentials: {e}")))?;
        let o = crate::connect::with_tls(o, opts)?;
        let client = o
            .connect(crate::connect::server_addrs(opts)?)
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        Ok(AccountPush {
            client,
            account: account.to_string(),
        })
    }

    /// The account JWT the server holds now.
    pub async fn current(&self) -> Result<String, BusError> {
        let subject = subjects::claims_lookup(&self.account);
        let reply = self.request(&subject, Vec::new()).await?;
        let text = String::from_utf8_lossy(&reply).trim().to_string();
        if text.is_empty() || text.starts_with('{') {
            return Err(BusError::Request {
                subject,
                message: format!("no account JWT in the answer: {text}"),
            });
        }
        Ok(text)
    }

    /// Hands the server `jwt`, a newer JWT of the account; the server applies it at once
    /// (closing the connections of the users it revokes) and keeps it in its resolver.
    pub async fn push(&self, jwt: &str) -> Result<(), BusError> {
        let subject = subjects::claims_update(&self.account);
        let reply = self.request(&subject, jwt.as_bytes().to_vec()).await?;
        let answer: serde_json::Value =
            serde_json::from_slice(&reply).map_err(|source| BusError::BadReply {
                subject: subject.clone(),
                source,
            })?;
        match answer["data"]["code"].as_u64() {
            Some(200) => Ok(()),
            _ => Err(BusError::Request {
                subject,
                message: format!("the server did not take the account: {answer}"),
            }),
        }
    }

    async fn request(&self, subject: &str, payload: Vec<u8>) -> Result<bytes::Bytes, BusError> {
        let asked = self.client.request(subject.to_string(), payload.into());
        match tokio::time::timeout(ANSWER, asked).await {
            Ok(Ok(msg)) => Ok(msg.payload),
            Ok(Err(err)) => Err(BusError::Request {
                subject: subject.to_string(),
                message: err.to_string(),
            }),
            Err(_) => Err(BusError::Timeout {
                subject: subject.to_string(),
                timeout: ANSWER,
            }),
        }
    }
}
