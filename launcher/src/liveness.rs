//! This launcher's liveness: the token its request workers watch, replaced each time
//! the liveness lease ([`crate::lease::take_liveness`]) is taken again.

use std::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// This launcher's liveness lease (`launcher.<id>`): while it stands, no other launcher
/// takes over the requests this one owns. [`Liveness::token`] is cancelled when the lease
/// is lost (the bus was out of reach for longer than the lease TTL): the request workers
/// stop, as others may take their requests over, and the lease is taken again.
pub struct Liveness {
    current: Mutex<CancellationToken>,
}

impl Liveness {
    pub fn new(shutdown: &CancellationToken) -> Liveness {
        Liveness {
            current: Mutex::new(shutdown.child_token()),
        }
    }

    /// Cancelled when the liveness lease held now is lost (or at shutdown).
    pub fn token(&self) -> CancellationToken {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Installs the token of a lease just taken ([`crate::lease::take_liveness`]).
    pub(crate) fn set(&self, token: CancellationToken) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = token;
    }
}
