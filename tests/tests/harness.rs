//! The test fixtures themselves: a server restart keeps the store and the port, and
//! clients reconnect.

use slotpool_tests::{wait_for, NatsServer};
use std::time::Duration;

#[tokio::test]
async fn restart_keeps_port_and_store_and_clients_reconnect() {
    let mut server = NatsServer::start().await;
    let url = server.url();
    let bus = server.bus().await;
    let rev = bus.slots.create("bn-a.0", &1u32, None).await.unwrap();

    server.restart().await;
    assert_eq!(server.url(), url);
    wait_for(
        "the old connection to reconnect",
        Duration::from_secs(20),
        || async { bus.is_connected() },
    )
    .await;
    let got = bus.slots.get::<u32>("bn-a.0").await.unwrap().unwrap();
    assert_eq!((got.revision, got.value), (rev, 1));
}

#[tokio::test]
async fn crash_and_resume_keeps_acknowledged_writes() {
    let mut server = NatsServer::start().await;
    let bus = server.bus().await;
    let rev = bus.slots.create("bn-a.0", &1u32, None).await.unwrap();
    server.crash();
    assert!(!server.is_running());
    server.resume().await;
    let fresh = server.bus().await;
    let got = fresh.slots.get::<u32>("bn-a.0").await.unwrap().unwrap();
    assert_eq!(got.revision, rev);
}
