//! The server's refusals of what a connection may not do, turned into errors of the call
//! that did it.
//!
//! A publish to a subject the user may not publish on is dropped by the server, which
//! sends the connection a `-ERR 'Permissions Violation for Publish to "<subject>"'`. The
//! NATS client hands that to its event callback only: the request, KV read or watch that
//! sent it would wait out its timeout and say "timed out". [`Refusals`] carries each
//! refusal from the callback to the calls waiting on this connection, and
//! [`Refusals::guard`] ends the call whose subject was refused at once, with an error
//! that says so.
//!
//! A launcher may use every subject: its connection has no [`Refusals`], and its calls
//! pay nothing for them.

use crate::auth::BusUser;
use std::future::Future;
use tokio::sync::broadcast;

/// How many refusals a slow caller may be behind before older ones are dropped for it
/// (it then only misses that its own call was refused, and waits out its timeout).
const BACKLOG: usize = 64;

/// One subject the server refused this connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The subject named in the server's permissions violation.
    pub subject: String,
    /// Whether a subscription was refused (otherwise a publish).
    pub subscribe: bool,
}

impl Refusal {
    /// The refusal a server error's text reports, if it is a permissions violation
    /// (`Permissions Violation for Publish to "<subject>"`, or `for Subscription to`).
    pub fn parse(text: &str) -> Option<Refusal> {
        let (_, rest) = text.split_once("Permissions Violation for ")?;
        let (kind, rest) = rest.split_once(" to ")?;
        let subscribe = match kind {
            "Publish" => false,
            "Subscription" => true,
            _ => return None,
        };
        let rest = rest.trim_start().strip_prefix('"')?;
        let (subject, _) = rest.split_once('"')?;
        Some(Refusal {
            subject: subject.to_string(),
            subscribe,
        })
    }
}

/// The refusals of one connection, as the server reports them, for the calls on it.
#[derive(Clone, Debug)]
pub struct Refusals {
    tx: broadcast::Sender<Refusal>,
    /// Who the connection is, for error messages (`client ci`).
    user: String,
}

impl Refusals {
    /// Refusals of the connection of `user`.
    pub fn new(user: &BusUser) -> Refusals {
        Refusals {
            tx: broadcast::channel(BACKLOG).0,
            user: user.to_string(),
        }
    }

    /// Passes a refusal the server reported on to the calls waiting.
    pub fn report(&self, refusal: Refusal) {
        // No call waiting: nothing to tell.
        let _ = self.tx.send(refusal);
    }

    /// Who the connection is (`client ci`).
    pub fn user(&self) -> &str {
        &self.user
    }

    /// Runs `call` until it ends or the server refuses a subject `concerns` the call
    /// (then the refused subject). The refusals are listened to from before `call`
    /// starts, so one that comes at once is not missed.
    pub async fn guard<T>(
        &self,
        concerns: impl Fn(&Refusal) -> bool,
        call: impl Future<Output = T>,
    ) -> Result<T, Refusal> {
        let mut rx = self.tx.subscribe();
        let refused = async {
            loop {
                match rx.recv().await {
                    Ok(refusal) if concerns(&refusal) => return refusal,
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    // The sender lives as long as the connection's callback; without it
                    // no refusal comes.
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                }
            }
        };
        tokio::select! {
            biased;
            out = call => Ok(out),
            refusal = refused => Err(refusal),
        }
    }
}

/// Whether `subject` has `token` as one of its dot-separated tokens.
pub(crate) fn has_token(subject: &str, token: &str) -> bool {
    subject.split('.').any(|t| t == token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Role;
    use std::time::Duration;

    #[test]
    fn permission_violations_are_read_from_the_servers_text() {
        assert_eq!(
            Refusal::parse(
                "Permissions Violation for Publish to \"$JS.API.CONSUMER.CREATE.KV_slotpool_requests\""
            ),
            Some(Refusal {
                subject: "$JS.API.CONSUMER.CREATE.KV_slotpool_requests".into(),
                subscribe: false
            })
        );
        assert_eq!(
            Refusal::parse(
                "nats: Permissions Violation for Subscription to \"slotpool.agent.v2.bn-x\""
            ),
            Some(Refusal {
                subject: "slotpool.agent.v2.bn-x".into(),
                subscribe: true
            })
        );
        assert_eq!(Refusal::parse("authorization violation"), None);
        assert_eq!(Refusal::parse("Permissions Violation for Publish to"), None);
    }

    #[tokio::test]
    async fn a_refusal_of_the_calls_subject_ends_it_and_others_do_not() {
        let refusals = Refusals::new(&BusUser::new(Role::Client, "ci").unwrap());
        let r = refusals.clone();
        let sent = tokio::spawn(async move {
            r.guard(
                |f| f.subject == "a.b",
                tokio::time::sleep(Duration::from_secs(30)),
            )
            .await
        });
        // The guard listens before its call starts: wait until it does.
        while refusals.tx.receiver_count() == 0 {
            tokio::task::yield_now().await;
        }
        refusals.report(Refusal {
            subject: "other".into(),
            subscribe: false,
        });
        refusals.report(Refusal {
            subject: "a.b".into(),
            subscribe: false,
        });
        let refused = tokio::time::timeout(Duration::from_secs(5), sent)
            .await
            .expect("ended by the refusal")
            .unwrap()
            .unwrap_err();
        assert_eq!(refused.subject, "a.b");
        let done = refusals.guard(|_| true, async { 7 }).await;
        assert_eq!(done, Ok(7));
    }
}
