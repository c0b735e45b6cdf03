//! This launcher's liveness: the token its request workers watch, replaced each time
//! the liveness lease ([`crate::lease::take_liveness`]) is taken again.

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// This launcher's liveness lease (`launcher.<id>`): while it stands, no other launcher
/// takes over the requests this one owns. [`Liveness::token`] is cancelled when the lease
/// is lost (the bus was out of reach for longer than the lease TTL): the request workers
/// stop, as others may take their requests over, and the lease is taken again; then
/// they go on at once ([`Liveness::taken_again`]).
pub struct Liveness {
    current: watch::Sender<CancellationToken>,
}

impl Liveness {
    pub fn new(shutdown: &CancellationToken) -> Liveness {
        Liveness {
            current: watch::channel(shutdown.child_token()).0,
        }
    }

    /// Cancelled when the liveness lease held now is lost (or at shutdown).
    pub fn token(&self) -> CancellationToken {
        self.current.borrow().clone()
    }

    /// Installs the token of a lease just taken ([`crate::lease::take_liveness`]).
    pub(crate) fn set(&self, token: CancellationToken) {
        self.current.send_replace(token);
    }

    /// Waits until the lease is held again and returns its token (never returns at
    /// shutdown, which cancels every token: select on it).
    pub async fn taken_again(&self) -> CancellationToken {
        let mut rx = self.current.subscribe();
        let token = rx.wait_for(|t| !t.is_cancelled()).await.map(|t| t.clone());
        match token {
            Ok(token) => token,
            Err(_) => std::future::pending().await,
        }
    }
}
