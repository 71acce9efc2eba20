//! How a [`Board`] is drawn: a terminal screen (ratatui) and a plain line.

use std::fmt::Write as _;

use ratatui::layout::{Constraint, Direction, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Sparkline, Table, Wrap};
use ratatui::Frame;

use super::client::{Board, EndpointView, TenantView, UpstreamView};

const COLOURS: [Color; 6] = [
    Color::Cyan,
    Color::Magenta,
    Color::Green,
    Color::Yellow,
    Color::Blue,
    Color::Red,
];

/// What the plain lines' fields mean, printed once above them.
pub const LEGEND: &str =
    "per upstream: in = requests in flight now / the cap (- for none), q = queued, \
conc = mean in flight over the window, 1-stream = single-stream T/s (1000 / mean TPOT), \
system = all tokens per second, TPOT p50/p90 and TTFT p50 in ms";

fn f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

fn limit(u: &UpstreamView) -> String {
    u.limit.map_or_else(|| "-".into(), |l| l.to_string())
}

/// One line for a snapshot: every upstream's figures, then the note.
pub fn plain_line(board: &Board, note: &str) -> String {
    if let Some(p) = &board.problem {
        return format!("tokentap: {p}");
    }
    let mut out = String::new();
    if !note.is_empty() {
        let _ = write!(out, "{note}  ");
    }
    for (i, u) in board.upstreams.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        let _ = write!(
            out,
            "{}: in {}/{} q {} conc {} 1-stream {} system {} TPOT {}/{} TTFT {}",
            u.name,
            u.in_flight,
            limit(u),
            u.queued,
            f(u.concurrency, 1),
            f(u.single_stream_tps, 1),
            f(u.system_tps, 0),
            f(u.tpot_ms.p50, 1),
            f(u.tpot_ms.p90, 1),
            f(u.ttft_ms.p50, 0),
        );
        let decided = decisions(u);
        if !decided.is_empty() {
            let _ = write!(out, " {decided}");
        }
        if u.endpoints.len() > 1 {
            let healthy = u.endpoints.iter().filter(|e| e.healthy).count();
            let _ = write!(out, " endpoints {healthy}/{} healthy", u.endpoints.len());
        }
    }
    for r in &board.rollouts {
        let _ = write!(out, " | rollout {}", r.line());
    }
    for (i, t) in board.tenants.iter().take(TENANT_LINES).enumerate() {
        out.push_str(if i == 0 { " | tenants: " } else { ", " });
        let _ = write!(
            out,
            "{} {:.0}% {:.0} T/s TTFT {} q {:.0} ms refused {}",
            t.tenant,
            t.output_share_pct,
            t.output_tps,
            f(t.ttft_ms.p50, 0),
            t.queue_wait_ms,
            t.refused_total
        );
    }
    out
}

/// Tenants shown, at most.
const TENANT_LINES: usize = 6;

/// A tenant's line: its share of the tokens, T/s, TTFT, queue wait and refusals.
fn tenant_line(t: &TenantView) -> Line<'static> {
    Line::from(format!(
        "{:<26} {:>5.1}% of the tokens {:>7.0} T/s   TTFT p50 {:>6} ms   queue {:>6.0} ms   refused {}",
        t.tenant,
        t.output_share_pct,
        t.output_tps,
        f(t.ttft_ms.p50, 0),
        t.queue_wait_ms,
        t.refused_total
    ))
}

/// The SLOs set, as one phrase: "TTFT ≤ 500 ms, TPOT p90 ≤ 30 ms".
fn slo_text(s: &super::client::Slo) -> String {
    let mut parts = Vec::new();
    if let Some(t) = s.ttft_ms {
        parts.push(format!("TTFT ≤ {t} ms"));
    }
    if let Some(t) = s.tpot_ms {
        parts.push(format!("TPOT p{} ≤ {t} ms", s.percentile));
    }
    if let Some(t) = s.e2e_ms {
        parts.push(format!("e2e ≤ {t} ms"));
    }
    parts.join(", ")
}

/// What the figures decide, as one phrase: "good 91% · 0.193 USD/M · MBU 84% · needs 4 (add 2)".
fn decisions(u: &UpstreamView) -> String {
    let mut parts = Vec::new();
    if let Some(g) = &u.goodput {
        parts.push(format!(
            "good {}% ({} req/s)",
            f(g.attainment_pct, 0),
            f(g.requests_per_sec, 1)
        ));
    }
    if let Some(c) = &u.cost {
        let unit = c.currency.as_deref().unwrap_or("");
        parts.push(format!("{} {unit}/M", f(c.per_million_output_tokens, 3)).replace(" /M", "/M"));
    }
    if let Some(r) = &u.roofline {
        parts.push(match &r.problem {
            Some(_) => "MBU: check model size and GPU".to_owned(),
            None => format!("MBU {}%", f(r.mbu_pct, 0)),
        });
    }
    if let Some(c) = u.capacity.as_ref().filter(|c| c.endpoints_needed.is_some()) {
        parts.push(format!(
            "needs {} of {} ({})",
            c.endpoints_needed.unwrap_or(0),
            c.endpoints_now,
            c.advice.as_deref().unwrap_or("-")
        ));
    }
    parts.join(" · ")
}

/// The screen: a title line, a block per upstream, the A/B verdict.
pub fn draw(frame: &mut Frame<'_>, title: &str, note: &str, board: &Board) {
    let mut rows = vec![Constraint::Length(1)];
    rows.extend(
        (board.upstreams.iter()).map(|u| Constraint::Length(10 + endpoint_lines(u) as u16)),
    );
    if board.upstreams.is_empty() {
        rows.push(Constraint::Length(10));
    }
    let tenants = board.tenants.len().min(TENANT_LINES);
    if tenants > 0 {
        rows.push(Constraint::Length(2 + tenants as u16));
    }
    rows.push(Constraint::Length(5 + board.rollouts.len() as u16));
    rows.push(Constraint::Min(0));
    let areas = Layout::default()
        .direction(Direction::Vertical)
        .constraints(rows)
        .split(frame.area());

    let when = chrono::DateTime::from_timestamp_millis(i64::try_from(board.t).unwrap_or(0))
        .map(|t| {
            t.with_timezone(&chrono::Local)
                .format("%H:%M:%S")
                .to_string()
        })
        .unwrap_or_default();
    let mut head = vec![Span::styled(
        title.to_owned(),
        Style::new().add_modifier(Modifier::BOLD),
    )];
    if board.t > 0 {
        head.push(Span::raw(format!(
            "   v{}  window {} s  {when}",
            board.version, board.window_secs
        )));
    }
    if !note.is_empty() {
        head.push(Span::styled(
            format!("   {note}"),
            Style::new().fg(Color::Yellow),
        ));
    }
    if let Some(p) = &board.problem {
        head.push(Span::styled(format!("   {p}"), Style::new().fg(Color::Red)));
    }
    head.push(Span::styled("   q quits", Style::new().fg(Color::DarkGray)));
    frame.render_widget(Paragraph::new(Line::from(head)), areas[0]);

    for (i, u) in board.upstreams.iter().enumerate() {
        upstream(frame, areas[1 + i], u, board, COLOURS[i % COLOURS.len()]);
    }
    if tenants > 0 {
        let lines: Vec<Line> = board
            .tenants
            .iter()
            .take(tenants)
            .map(tenant_line)
            .collect();
        let block = Block::default()
            .borders(Borders::ALL)
            .title(" tenants (by output tokens) ");
        frame.render_widget(Paragraph::new(lines).block(block), areas[areas.len() - 3]);
    }
    let mut verdict = board.verdict.clone().unwrap_or_else(|| {
        "no route splits traffic between two upstreams: nothing to compare".into()
    });
    if let Some(shadow) = &board.shadow {
        verdict = format!("{verdict}\nshadow: {shadow}");
    }
    for r in &board.rollouts {
        verdict = format!("{verdict}\nrollout {}", r.line());
    }
    let block = Block::default()
        .borders(Borders::ALL)
        .title(" A/B verdict (GET /compare) ");
    frame.render_widget(
        Paragraph::new(verdict)
            .wrap(Wrap { trim: true })
            .block(block),
        areas[areas.len() - 2],
    );
}

/// The lines a pool's endpoints take (none for one endpoint), at most eight.
fn endpoint_lines(u: &UpstreamView) -> usize {
    if u.endpoints.len() > 1 {
        u.endpoints.len().min(8)
    } else {
        0
    }
}

/// An endpoint's line: its state, address, in flight / cap, T/s.
fn endpoint_line(e: &EndpointView) -> Line<'static> {
    let (mark, state, colour) = match (e.healthy, e.health_checks_pass) {
        (true, _) => ("●", "", Color::Green),
        (false, true) => ("✗", "  ejected", Color::Red),
        (false, false) => ("✗", "  unhealthy", Color::Red),
    };
    let cap = e.limit.map_or_else(|| "-".into(), |l| l.to_string());
    Line::from(vec![
        Span::styled(format!("{mark} "), Style::new().fg(colour)),
        Span::raw(format!(
            "{:<28} in flight {:>3} / {cap:<4} {:>6} T/s",
            e.address,
            e.in_flight,
            f(e.system_tps, 0)
        )),
        Span::styled(state.to_owned(), Style::new().fg(colour)),
    ])
}

fn upstream(frame: &mut Frame<'_>, area: Rect, u: &UpstreamView, board: &Board, colour: Color) {
    let block = Block::default()
        .borders(Borders::ALL)
        .border_style(Style::new().fg(colour))
        .title(Span::styled(
            format!(" {} ", u.name),
            Style::new().fg(colour).add_modifier(Modifier::BOLD),
        ));
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let parts = Layout::default()
        .direction(Direction::Vertical)
        .constraints([
            Constraint::Length(6),
            Constraint::Length(2),
            Constraint::Min(0),
        ])
        .split(inner);
    let (inner, wide, pool) = (parts[0], parts[1], parts[2]);
    let shown = endpoint_lines(u);
    if shown > 0 {
        let lines: Vec<Line> = u.endpoints.iter().take(shown).map(endpoint_line).collect();
        frame.render_widget(Paragraph::new(lines), pool);
    }
    let cols = Layout::default()
        .direction(Direction::Horizontal)
        .constraints([
            Constraint::Length(46),
            Constraint::Length(44),
            Constraint::Min(20),
        ])
        .split(inner);

    let slo = match &u.slo {
        Some(s) => format!(
            "SLO {}{}{}",
            slo_text(s),
            if s.tpot_ms.is_some() {
                format!(": TPOT now {} ms", f(s.current_tpot_ms, 1))
            } else {
                String::new()
            },
            match s.met {
                Some(true) => " (met)".to_owned(),
                Some(false) if s.missed.is_empty() => " (missed)".to_owned(),
                Some(false) => format!(" ({} missed)", missed_text(&s.missed)),
                None => String::new(),
            }
        ),
        None => "no SLO".into(),
    };
    let exact = u.estimated_tokens_share_pct.map(|e| 100.0 - e);
    let figures = vec![
        Line::from(format!(
            "in flight {} / limit {}   queued {}",
            u.in_flight,
            limit(u),
            u.queued
        )),
        Line::from(format!(
            "mean in flight {} (over {} s)",
            f(u.concurrency, 1),
            board.window_secs
        )),
        Line::from(vec![
            Span::raw("single-stream "),
            Span::styled(
                f(u.single_stream_tps, 1),
                Style::new().add_modifier(Modifier::BOLD),
            ),
            Span::raw(" T/s   system "),
            Span::styled(
                f(u.system_tps, 0),
                Style::new().add_modifier(Modifier::BOLD),
            ),
            Span::raw(" T/s"),
        ]),
        Line::from(format!(
            "TPOT p50 {} ms  p90 {} ms",
            f(u.tpot_ms.p50, 1),
            f(u.tpot_ms.p90, 1)
        )),
        Line::from(format!(
            "TTFT p50 {} ms  p90 {} ms",
            f(u.ttft_ms.p50, 0),
            f(u.ttft_ms.p90, 0)
        )),
        Line::from(format!(
            "requests {}   counted exactly {}%   prefix cache {}",
            u.requests_total,
            f(exact, 0),
            u.cache_hit_rate_pct
                .map_or_else(|| "not reported".to_owned(), |h| format!("{h:.0}% hit"))
        )),
    ];
    frame.render_widget(Paragraph::new(figures), cols[0]);
    // The SLO and what the figures decide, across the block.
    let decided = vec![Line::from(slo), Line::from(decisions(u))];
    frame.render_widget(Paragraph::new(decided), wide);

    // The curve: the buckets with the most samples, in concurrency order.
    let mut curve: Vec<_> = u.curve.iter().filter(|p| !p.sparse).cloned().collect();
    let keep = usize::from(cols[1].height.saturating_sub(1));
    if curve.len() > keep {
        curve.sort_by_key(|p| std::cmp::Reverse(p.samples));
        curve.truncate(keep);
        curve.sort_by_key(|p| p.concurrency);
    }
    let rows = curve.iter().map(|p| {
        Row::new([
            Cell::from(format!("≤{}", p.concurrency)),
            Cell::from(f(p.tpot_ms_p50, 1)),
            Cell::from(f(p.tpot_ms_p90, 1)),
            Cell::from(f(p.system_tps, 0)),
        ])
    });
    let table = Table::new(
        rows,
        [
            Constraint::Length(10),
            Constraint::Length(9),
            Constraint::Length(8),
            Constraint::Length(11),
        ],
    )
    .header(
        Row::new(["in flight", "TPOT p50", "p90 ms", "system T/s"])
            .style(Style::new().add_modifier(Modifier::UNDERLINED)),
    );
    frame.render_widget(table, cols[1]);

    let series: Vec<u64> = board
        .system_tps
        .get(&u.name)
        .map(|s| s.iter().map(|v| v.round().max(0.0) as u64).collect())
        .unwrap_or_default();
    let width = usize::from(cols[2].width);
    let shown = &series[series.len().saturating_sub(width)..];
    let max = shown.iter().copied().max().unwrap_or(0);
    let spark = Sparkline::default()
        .block(Block::default().title(format!("system T/s, last {} s (max {max})", shown.len())))
        .data(shown)
        .style(Style::new().fg(colour));
    frame.render_widget(spark, cols[2]);
}

/// The SLOs that miss, as the SLO line names them: `TTFT`, `TPOT and e2e`.
fn missed_text(missed: &[String]) -> String {
    let names: Vec<&str> = (missed.iter())
        .map(|m| match m.as_str() {
            "ttft" => "TTFT",
            "tpot" => "TPOT",
            "e2e" => "e2e",
            "error" => "errors",
            other => other,
        })
        .collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::top::client::Pct;

    fn board() -> Board {
        Board {
            t: 1,
            version: "0.1.0".into(),
            window_secs: 5,
            upstreams: vec![UpstreamView {
                name: "a".into(),
                in_flight: 12,
                limit: Some(48),
                concurrency: Some(12.2),
                single_stream_tps: Some(70.66),
                system_tps: Some(824.4),
                tpot_ms: Pct {
                    p50: Some(14.2),
                    p90: Some(14.4),
                },
                ..UpstreamView::default()
            }],
            verdict: Some("a is faster".into()),
            ..Board::default()
        }
    }

    #[test]
    fn a_plain_line_per_snapshot() {
        assert_eq!(
            plain_line(&board(), "t=3s 32 clients"),
            "t=3s 32 clients  a: in 12/48 q 0 conc 12.2 1-stream 70.7 system 824 TPOT 14.2/14.4 TTFT -"
        );
    }

    /// Goodput, cost per token, MBU and the endpoints needed: in the block and the line.
    #[test]
    fn the_decisions_are_shown() {
        use crate::top::client::{Capacity, Cost, Goodput, Roofline, Slo};
        let mut board = board();
        let u = &mut board.upstreams[0];
        u.slo = Some(Slo {
            ttft_ms: Some(500.0),
            tpot_ms: Some(30.0),
            percentile: 90.0,
            ..Slo::default()
        });
        u.goodput = Some(Goodput {
            requests_per_sec: Some(12.5),
            attainment_pct: Some(91.2),
        });
        u.cost = Some(Cost {
            currency: Some("USD".into()),
            per_million_output_tokens: Some(0.1934),
        });
        u.roofline = Some(Roofline {
            mbu_pct: Some(84.3),
            problem: None,
        });
        u.capacity = Some(Capacity {
            endpoints_now: 2,
            endpoints_needed: Some(4),
            advice: Some("add 2".into()),
        });
        let want = "good 91% (12.5 req/s) · 0.193 USD/M · MBU 84% · needs 4 of 2 (add 2)";
        assert!(screen(&board, 24).contains(want), "{}", screen(&board, 24));
        assert!(plain_line(&board, "").contains(want));
        assert!(screen(&board, 24).contains("SLO TTFT ≤ 500 ms, TPOT p90 ≤ 30 ms"));
    }

    /// What `draw` puts on a 130-column screen of `rows`, as one string.
    fn screen(board: &Board, rows: u16) -> String {
        let backend = ratatui::backend::TestBackend::new(130, rows);
        let mut terminal = ratatui::Terminal::new(backend).unwrap_or_else(|e| panic!("{e}"));
        terminal
            .draw(|f| draw(f, "tokentap top", "", board))
            .unwrap_or_else(|e| panic!("{e}"));
        let buffer = terminal.backend().buffer();
        buffer.content().iter().map(|c| c.symbol()).collect()
    }

    #[test]
    fn the_screen_draws_every_figure() {
        let text = screen(&board(), 24);
        for want in [
            "in flight 12 / limit 48",
            "single-stream 70.7",
            "system 824",
            "a is faster",
        ] {
            assert!(text.contains(want), "{want} missing");
        }
    }

    /// With `[tenants]`: a line per tenant on the screen, and in the plain line.
    #[test]
    fn the_tenants_are_shown() {
        let mut board = board();
        board.tenants = vec![TenantView {
            tenant: "team-a".into(),
            output_share_pct: 62.5,
            output_tps: 410.0,
            ttft_ms: Pct {
                p50: Some(18.0),
                p90: None,
            },
            queue_wait_ms: 3.2,
            refused_total: 4,
        }];
        let text = screen(&board, 30);
        assert!(text.contains("team-a"), "{text}");
        assert!(text.contains("62.5% of the tokens"), "{text}");
        assert!(plain_line(&board, "")
            .ends_with(" | tenants: team-a 62% 410 T/s TTFT 18 q 3 ms refused 4"));
    }

    /// A pool's endpoints: a line each, with its state, in the block and the plain line.
    #[test]
    fn a_pool_shows_its_endpoints() {
        let mut board = board();
        let endpoint = |address: &str, healthy: bool, checks: bool| EndpointView {
            address: address.into(),
            healthy,
            health_checks_pass: checks,
            in_flight: 3,
            limit: Some(8),
            system_tps: Some(120.0),
        };
        board.upstreams[0].endpoints = vec![
            endpoint("http://10.0.0.1:8000", true, true),
            endpoint("http://10.0.0.2:8000", false, true),
            endpoint("http://10.0.0.3:8000", false, false),
        ];
        let text = screen(&board, 30);
        for want in [
            "http://10.0.0.1:8000",
            "in flight   3 / 8",
            "ejected",
            "unhealthy",
            "in flight 12 / limit 48",
        ] {
            assert!(text.contains(want), "{want} missing");
        }
        assert!(plain_line(&board, "").ends_with("endpoints 1/3 healthy"));
    }
}
