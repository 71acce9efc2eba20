//! `tokentap top`: the live figures of any running tokentap in the terminal, read from its
//! admin API as the dashboard reads them (`/stats/history`, then `/events`). On a terminal
//! it is redrawn in place (ratatui); otherwise one plain line a second. `tokentap demo`
//! shows its own run through the same view.

mod client;
mod view;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use tokio::sync::watch;

pub use client::{watch as client_watch, Board, Source};
pub use view::plain_line;

#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// The admin API of the tokentap to watch.
    #[arg(long, default_value = "http://127.0.0.1:9191")]
    pub admin: String,
    /// A file holding the admin token (default: TOKENTAP_ADMIN_TOKEN, if set).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

pub fn run(args: TopArgs) -> anyhow::Result<()> {
    let token = match &args.token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the token file {}", path.display()))?
                .trim()
                .to_owned(),
        ),
        None => std::env::var(crate::config::ADMIN_TOKEN_ENV).ok(),
    };
    let source = Source::parse(&args.admin, token)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let boards = client::watch(source.clone());
        let (_keep, stop) = watch::channel(false);
        let (_note_tx, note) = watch::channel(String::new());
        show(
            &format!("tokentap top — {}", source.url()),
            boards,
            note,
            stop,
        )
        .await
    })
}

/// Shows `boards` until `stop` turns true or the user quits (q, Esc, Ctrl-C): redrawn in
/// place on a terminal, one plain line a second otherwise. `note` is a line of the
/// caller's (the demo's current phase).
pub async fn show(
    title: &str,
    boards: watch::Receiver<Arc<Board>>,
    note: watch::Receiver<String>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        let title = title.to_owned();
        // SIGTERM or SIGHUP (a closed terminal) end the view as q does, so the terminal is
        // given back as it was.
        let (ended, end) = watch::channel(false);
        let watcher = tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            if let (Ok(mut term), Ok(mut hup)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::hangup()),
            ) {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
                let _ = ended.send(true);
            }
        });
        let shown =
            tokio::task::spawn_blocking(move || screen(&title, boards, note, stop, end)).await;
        watcher.abort();
        shown?
    } else {
        lines(boards, note, stop).await;
        Ok(())
    }
}

/// The terminal view, redrawn every 250 ms (a new snapshot arrives every second).
fn screen(
    title: &str,
    boards: watch::Receiver<Arc<Board>>,
    note: watch::Receiver<String>,
    stop: watch::Receiver<bool>,
    end: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut terminal = ratatui::init();
    let result = (|| -> anyhow::Result<()> {
        loop {
            if *stop.borrow() || *end.borrow() {
                return Ok(());
            }
            let board = Arc::clone(&boards.borrow());
            let note = note.borrow().clone();
            terminal.draw(|f| view::draw(f, title, &note, &board))?;
            if event::poll(Duration::from_millis(250))? {
                if let Event::Key(k) = event::read()? {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if k.kind == KeyEventKind::Press
                        && (ctrl_c || matches!(k.code, KeyCode::Char('q') | KeyCode::Esc))
                    {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result
}

/// Plain lines: one per snapshot, no header repeated.
async fn lines(
    mut boards: watch::Receiver<Arc<Board>>,
    note: watch::Receiver<String>,
    mut stop: watch::Receiver<bool>,
) {
    println!("{}", view::LEGEND);
    let mut last = 0;
    loop {
        tokio::select! {
            changed = boards.changed() => if changed.is_err() { return },
            _ = stop.changed() => return,
            _ = tokio::signal::ctrl_c() => return,
        }
        let board = Arc::clone(&boards.borrow_and_update());
        if board.t > last {
            last = board.t;
            println!("{}", plain_line(&board, &note.borrow()));
        }
    }
}
