//! The event loop: terminal input, watch batches, connection changes and a 1 s tick in,
//! a redraw out whenever something changed. Orders run in their own tasks and report
//! back as messages, so a slow launcher never freezes the screen.

use crate::rules::Rules;
use crate::state::{update, Command, Msg, State};
use crate::theme::Theme;
use crate::{feed, keys, view};
use anyhow::Context;
use crossterm::event::{Event as TermEvent, EventStream, KeyEventKind};
use futures::{Stream, StreamExt};
use ratatui::backend::Backend;
use ratatui::Terminal;
use slotpool_protocol::client::Client;
use slotpool_protocol::connect::{Bus, Link, NatsOptions};
use slotpool_protocol::time::now_ms;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Re-render at least this often, for the countdowns.
const TICK: Duration = Duration::from_secs(1);
/// Watch batches queued for the drawing task before the feeds wait.
const CHANNEL: usize = 256;
/// Most queued messages applied before a redraw.
const DRAIN: usize = 1024;
/// How long running orders and feeds get to finish when the console quits.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// How the console runs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Timers and pool sizes from the launcher's config, if given.
    pub rules: Rules,
    pub theme: Theme,
    /// Quit after the first render that shows every bucket loaded (start-up timing).
    pub exit_after_first_render: bool,
}

/// What a run of the console measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    /// From the start of the loop to the first frame with every bucket loaded.
    pub first_full_render: Option<Duration>,
    /// Backing nodes shown in that frame.
    pub backing_nodes: usize,
}

/// Connects to NATS and runs the console on this terminal until the operator quits or
/// `shutdown` is cancelled. The terminal is restored on every way out, panics included.
pub async fn run_console(
    opts: NatsOptions,
    settings: Settings,
    shutdown: CancellationToken,
) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let (bus, link) = Bus::connect_watching(&opts)
        .await
        .with_context(|| format!("connecting to NATS at {}", opts.url))?;
    let mut terminal = ratatui::try_init().context("setting up the terminal")?;
    let result = run_on(
        &mut terminal,
        bus,
        link,
        &opts.url,
        EventStream::new(),
        settings,
        shutdown,
        started,
    )
    .await;
    ratatui::restore();
    result
}

/// The console on any ratatui backend, with `input` as its terminal events (tests give
/// a [`ratatui::backend::TestBackend`] and a stream of their own).
#[allow(clippy::too_many_arguments)]
pub async fn run_on<B, I>(
    terminal: &mut Terminal<B>,
    bus: Bus,
    mut link: watch::Receiver<Link>,
    endpoint: &str,
    mut input: I,
    settings: Settings,
    shutdown: CancellationToken,
    started: Instant,
) -> anyhow::Result<Outcome>
where
    B: Backend,
    B::Error: Send + Sync + 'static,
    I: Stream<Item = std::io::Result<TermEvent>> + Unpin,
{
    let (tx, mut rx) = mpsc::channel::<Msg>(CHANNEL);
    let tracker = TaskTracker::new();
    let stop = shutdown.child_token();
    feed::spawn_feeds(&bus, link.clone(), tx.clone(), stop.clone(), &tracker);
    let client = Client::from_bus(bus);
    let mut state = State::new(settings.rules.clone(), endpoint);
    let size = terminal.size().context("reading the terminal size")?;
    update(&mut state, Msg::Resize(size.width, size.height));
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut outcome = Outcome::default();
    let result = loop {
        let mut commands = Vec::new();
        tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            msg = rx.recv() => {
                let Some(msg) = msg else { break Ok(()) };
                commands.extend(update(&mut state, msg));
                for _ in 0..DRAIN {
                    match rx.try_recv() {
                        Ok(msg) => commands.extend(update(&mut state, msg)),
                        Err(_) => break,
                    }
                }
            }
            event = input.next() => match event {
                None => break Ok(()),
                Some(Err(err)) => break Err(anyhow::Error::from(err).context("reading terminal input")),
                Some(Ok(TermEvent::Key(key))) if key.kind != KeyEventKind::Release => {
                    // What the key means depends on the prompt open now.
                    if let Some(action) = keys::action(&key, &state.input) {
                        commands.extend(update(&mut state, Msg::Action(action)));
                    }
                }
                Some(Ok(TermEvent::Resize(w, h))) => {
                    update(&mut state, Msg::Resize(w, h));
                }
                Some(Ok(_)) => continue,
            },
            Ok(()) = link.changed() => {
                let up = *link.borrow_and_update() == Link::Up;
                update(&mut state, Msg::Link(up));
            }
            _ = tick.tick() => {}
        }
        update(&mut state, Msg::Tick(now_ms()));
        // Settled after every change, before drawing and before the commands go: settling
        // asks what the detail pane now calls for (another node's log tail or slot's
        // occupants, whatever moved the selection, or the log tail again on a tick).
        commands.extend(state.settle());
        let mut quit = false;
        for command in commands {
            match command {
                Command::Quit => quit = true,
                Command::AskOccupants {
                    backing_id,
                    slot,
                    ask,
                } => ask_agent(
                    (&client, &tx, &tracker),
                    move |c| async move { c.slot_occupants(&backing_id, slot).await },
                    move |result| Msg::Occupants { ask, result },
                ),
                Command::AskLogTail {
                    backing_id,
                    lines,
                    ask,
                } => ask_agent(
                    (&client, &tx, &tracker),
                    move |c| async move { c.log_tail(&backing_id, lines).await },
                    move |result| Msg::LogTail {
                        ask,
                        result: result.map(|tail| tail.lines),
                    },
                ),
                order => send_order(order, &client, &tx, &tracker),
            }
        }
        if quit {
            break Ok(());
        }
        if let Err(err) = terminal.draw(|frame| view::draw(frame, &state, &settings.theme)) {
            break Err(anyhow::Error::from(err).context("drawing"));
        }
        if outcome.first_full_render.is_none() && state.loaded() {
            outcome.first_full_render = Some(started.elapsed());
            outcome.backing_nodes = state.backing_count();
            if settings.exit_after_first_render {
                break Ok(());
            }
        }
    };
    stop.cancel();
    tracker.close();
    drop(rx);
    let _ = tokio::time::timeout(STOP_GRACE, tracker.wait()).await;
    result.map(|()| outcome)
}

/// Asks an agent a question through a launcher off the event loop, and hands the event
/// loop the answer (or why there is none) as `answered` makes it: a launcher answers
/// within its own timeout (an agent that does not answer is `unavailable`), the client
/// within `API_TIMEOUT`, so a pane says so rather than waiting for ever.
fn ask_agent<T, E, Q>(
    (client, tx, tracker): (&Client, &mpsc::Sender<Msg>, &TaskTracker),
    question: impl FnOnce(Client) -> Q + Send + 'static,
    answered: impl FnOnce(Result<T, String>) -> Msg + Send + 'static,
) where
    Q: std::future::Future<Output = Result<T, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let (client, tx) = (client.clone(), tx.clone());
    tracker.spawn(async move {
        let result = question(client).await.map_err(|err| err.to_string());
        let _ = tx.send(answered(result)).await;
    });
}

fn send_order(command: Command, client: &Client, tx: &mpsc::Sender<Msg>, tracker: &TaskTracker) {
    let (client, tx) = (client.clone(), tx.clone());
    tracker.spawn(async move {
        let (what, result) = match command {
            Command::Order {
                action,
                backing_id,
                reason,
            } => (
                format!("{} {backing_id}", action.as_str()),
                client
                    .order(action, backing_id, reason)
                    .await
                    .map(|taken| taken.message),
            ),
            Command::ReleaseNode { node_id, reason } => (
                format!("release {node_id}"),
                client.release_node(node_id, reason).await.map(|r| {
                    if r.released.is_empty() {
                        "already gone".to_string()
                    } else {
                        "released".to_string()
                    }
                }),
            ),
            Command::Quit | Command::AskOccupants { .. } | Command::AskLogTail { .. } => return,
        };
        let result = result.map_err(|err| err.to_string());
        if let Err(err) = &result {
            tracing::warn!(%what, %err, "order failed");
        }
        let _ = tx.send(Msg::OrderDone { what, result }).await;
    });
}
