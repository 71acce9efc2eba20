// tokentap's dashboard: /stats/history for the last 15 minutes, then one /events snapshot a
// second. Every figure shown comes from the snapshot of one second; `window.tokentap` holds
// that snapshot and the charts, for the browser test and for anyone curious.
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d"];
const HISTORY = 900;
const state = {
  token: /^[\x21-\x7e]+$/.test(sessionStorage.getItem("tokentap-token") || "") ? sessionStorage.getItem("tokentap-token") : "",
  history: [],
  snap: null,
  charts: {},
  key: "",
  errors: [],
  connected: false,
};
window.tokentap = state;
window.addEventListener("error", (e) => state.errors.push(String(e.message || e)));
window.addEventListener("unhandledrejection", (e) => state.errors.push(String(e.reason)));

const $ = (id) => document.getElementById(id);
const fmt = (v, d = 1) => (v === null || v === undefined || !isFinite(v) ? "–" : Number(v).toFixed(d));

// A colour per upstream that does not move when others come and go: its name's hash picks a
// slot, the next free one if taken (names taken in order, so every page agrees).
function colours(names) {
  const taken = new Map();
  const used = new Set();
  for (const name of [...names].sort()) {
    let h = 2166136261;
    for (const c of name) h = Math.imul(h ^ c.codePointAt(0), 16777619) >>> 0;
    let i = h % PALETTE.length;
    for (let n = 0; n < PALETTE.length && used.has(i); n++) i = (i + 1) % PALETTE.length;
    used.add(i);
    taken.set(name, PALETTE[i]);
  }
  return taken;
}

function headers() {
  return state.token ? { Authorization: "Bearer " + state.token } : {};
}

class Unauthorized extends Error {}

async function api(path) {
  const r = await fetch(path, { headers: headers(), cache: "no-store" });
  if (r.status === 401) throw new Unauthorized();
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r;
}

function setStatus(text, live) {
  const s = $("status");
  s.textContent = text;
  s.className = "status " + (live ? "live" : "down");
}

function askToken(message) {
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setStatus("needs the admin token", false);
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  const token = $("token").value.trim();
  // A header value: visible ASCII only (a pasted "…" or zero-width space would make fetch
  // throw before asking).
  if (!/^[\x21-\x7e]+$/.test(token)) {
    $("login-error").textContent = "a token is visible ASCII characters, without spaces";
    return;
  }
  state.token = token;
  sessionStorage.setItem("tokentap-token", state.token);
  start();
});

async function start() {
  try {
    // Asked first, so that a page without the token gets no 401 in its console.
    const auth = await (await api("/auth")).json();
    if (!auth.authorized) return askToken(state.token ? "that token was refused" : "");
    const h = await (await api("/stats/history")).json();
    state.history = h.points.slice(-HISTORY);
  } catch (e) {
    if (e instanceof Unauthorized) return askToken(state.token ? "that token was refused" : "");
    setStatus("cannot read /stats/history: " + e.message, false);
    return setTimeout(start, 2000);
  }
  $("login").hidden = true;
  $("main").hidden = false;
  if (state.history.length) render();
  listen();
}

// /events through fetch rather than EventSource, which cannot send the token. A snapshot
// comes every second; 5 s of silence is a connection that died quietly (a laptop that
// slept, a dropped NAT entry): it is dropped and the page starts again from the history.
async function listen() {
  const abort = new AbortController();
  let heard = Date.now();
  const watchdog = setInterval(() => {
    if (Date.now() - heard > 5000) abort.abort();
  }, 1000);
  try {
    const r = await fetch("/events", { headers: headers(), cache: "no-store", signal: abort.signal });
    if (r.status === 401) throw new Unauthorized();
    if (!r.ok) throw new Error("/events: HTTP " + r.status);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    state.connected = true;
    setStatus("live", true);
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      heard = Date.now();
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((l) => l.startsWith("data: "))
          .map((l) => l.slice(6))
          .join("\n");
        if (data) onSnapshot(JSON.parse(data));
      }
    }
  } catch (e) {
    if (e instanceof Unauthorized) {
      clearInterval(watchdog);
      return askToken("the token was refused");
    }
  }
  clearInterval(watchdog);
  state.connected = false;
  setStatus("disconnected: retrying…", false);
  setTimeout(start, 2000);
}

function onSnapshot(snap) {
  state.snap = snap;
  const last = state.history[state.history.length - 1];
  if (!last || last.t < snap.point.t) state.history.push(snap.point);
  if (state.history.length > HISTORY) state.history.splice(0, state.history.length - HISTORY);
  render();
}

function render() {
  const names = (state.snap ? state.snap.stats.upstreams : state.history[state.history.length - 1].upstreams).map((u) => u.name);
  const key = names.join("\u0000");
  if (key !== state.key) {
    state.key = key;
    state.colours = colours(names);
    buildCharts(names);
  }
  if (state.snap) {
    const s = state.snap;
    $("meta").textContent = `v${s.version} · window ${s.stats.window_secs} s · ${new Date(s.t).toLocaleTimeString()}`;
    renderUpstreams(s);
    renderVerdict(s.compare);
    renderTenants(s.stats.tenants);
    renderRollouts(s.stats.rollouts);
    $("shadow").hidden = !s.shadow;
    if (s.shadow) $("shadow-text").textContent = s.shadow.verdict;
  }
  updateCharts(names);
}

// ---- figures ----

function fig(up, name, value, digits, label) {
  return `<div class="fig"><div class="v" data-up="${esc(up)}" data-fig="${name}" data-value="${value ?? ""}">${fmt(value, digits)}</div><div class="l">${label}</div></div>`;
}

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// A pool's endpoints: state, in flight / cap, T/s, TPOT p50 (none for one endpoint).
function endpoints(u) {
  const eps = u.endpoints || [];
  if (eps.length < 2) return "";
  const state = (e) => (e.healthy ? "healthy" : e.health_checks_pass ? "ejected" : "unhealthy");
  const rows = eps
    .map(
      (e) => `<tr class="ep ${state(e)}" data-up="${esc(u.name)}" data-endpoint="${esc(e.address)}" data-state="${state(e)}">
        <td>${esc(e.address)}</td><td>${state(e)}</td><td>${e.in_flight} / ${e.limit ?? "–"}</td>
        <td>${fmt(e.system_tps, 0)}</td><td>${fmt(e.tpot_ms.p50)}</td><td>${e.requests_total}</td><td>${e.errors_total}</td></tr>`,
    )
    .join("");
  return `<table class="eps"><tr><th>endpoint (${esc(u.balance)})</th><th>state</th><th>in flight / cap</th><th>system T/s</th><th>TPOT p50</th><th>requests</th><th>errors</th></tr>${rows}</table>`;
}

// The SLOs set, as one phrase: "TTFT ≤ 500 ms, TPOT p90 ≤ 30 ms".
// What misses, named: "TTFT", "TPOT and e2e" ("SLO" when /stats does not say).
function missedText(missed) {
  const names = (missed || []).map((m) => ({ ttft: "TTFT", tpot: "TPOT", e2e: "e2e", error: "errors" })[m] || m);
  if (!names.length) return "SLO";
  return names.length === 1 ? names[0] : `${names.slice(0, -1).join(", ")} and ${names[names.length - 1]}`;
}

function sloText(slo) {
  const parts = [];
  if (slo.ttft_ms !== null) parts.push(`TTFT ≤ ${slo.ttft_ms} ms`);
  if (slo.tpot_ms !== null) parts.push(`TPOT p${slo.percentile} ≤ ${slo.tpot_ms} ms`);
  if (slo.e2e_ms !== null) parts.push(`e2e ≤ ${slo.e2e_ms} ms`);
  return parts.join(", ");
}

// What the figures decide: goodput, cost per token, MBU, the endpoints needed.
function decisions(u) {
  const g = u.goodput;
  const cost = u.cost;
  const roof = u.roofline;
  const cap = u.capacity;
  const figs = [];
  if (g) {
    figs.push(fig(u.name, "goodput_rps", g.requests_per_sec, 2, "goodput req/s (met every SLO)"));
    figs.push(fig(u.name, "attainment_pct", g.attainment_pct, 1, `% good (target ${fmt(u.slo.attainment_pct, 0)}%)`));
  }
  if (cost) {
    const cur = cost.currency ? ` ${esc(cost.currency)}` : "";
    figs.push(fig(u.name, "cost_per_million", cost.per_million_output_tokens, 3, `${cur} per M tokens now`));
    figs.push(fig(u.name, "cost_per_million_at_slo", cost.per_million_at_slo_bounded, 3, `${cur} per M at the SLO bound`));
  }
  if (roof) {
    figs.push(fig(u.name, "mbu_pct", roof.mbu_pct, 0, `% MBU (roofline ${fmt(roof.single_stream_ceiling_tps)} T/s)`));
  }
  if (cap && cap.endpoints_needed !== null) {
    figs.push(fig(u.name, "endpoints_needed", cap.endpoints_needed, 0, `endpoints needed (${cap.endpoints_now} now: ${esc(cap.advice)})`));
  }
  const notes = [];
  if (roof && roof.problem) notes.push(`<p class="problem" data-up="${esc(u.name)}" data-note="roofline_problem">roofline: ${esc(roof.problem)}</p>`);
  if (u.slo && cap && cap.reason) notes.push(`<p class="key" data-up="${esc(u.name)}" data-note="capacity_reason">capacity: ${esc(cap.reason)}</p>`);
  if (!figs.length && !notes.length) return "";
  return `<div class="figs decisions">${figs.join("")}</div>${notes.join("")}`;
}

function renderUpstreams(s) {
  const html = s.stats.upstreams.map((u) => {
    const c = state.colours.get(u.name);
    const exact = u.estimated_tokens_share_pct === null ? null : 100 - u.estimated_tokens_share_pct;
    const now = u.slo && u.slo.tpot_ms !== null ? `: TPOT now ${fmt(u.slo.current_tpot_ms)} ms` : "";
    const slo = u.slo
      ? `<span class="slo ${u.slo.met === false ? "missed" : "met"}" data-up="${esc(u.name)}" data-note="slo">SLO ${sloText(u.slo)}${now}${u.slo.met === null ? "" : u.slo.met ? " (met)" : ` (${missedText(u.slo.missed)} missed)`}</span>`
      : "no SLO";
    const row = (label, p, key) =>
      `<tr><td>${label}</td>${["p50", "p90", "p99"].map((q) => `<td data-up="${esc(u.name)}" data-fig="${key}_${q}" data-value="${p[q] ?? ""}">${fmt(p[q])}</td>`).join("")}</tr>`;
    return `<div class="card" style="--up:${c}">
      <h2 style="color:${c}">${esc(u.name)} <small>${u.mirror ? "mirror: copies of real requests, answers discarded" : u.arms.map((a) => `${esc(a.route)} ${fmt(a.share_pct, 0)}%`).join(", ")}</small></h2>
      <div class="figs">
        ${fig(u.name, "in_flight", u.in_flight, 0, "in flight")}
        ${fig(u.name, "limit", u.limit, 0, "limit (cap)")}
        ${fig(u.name, "queued", u.queued, 0, "queued")}
        ${fig(u.name, "concurrency", u.concurrency, 1, "mean in flight (window)")}
        ${fig(u.name, "single_stream_tps", u.single_stream_tps, 1, "single-stream T/s")}
        ${fig(u.name, "system_tps", u.system_tps, 0, "system T/s")}
        ${fig(u.name, "requests_total", u.requests_total, 0, "requests")}
        ${fig(u.name, "errors_total", u.errors_total, 0, "errors")}
      </div>
      <table class="pct"><tr><th>ms</th><th>p50</th><th>p90</th><th>p99</th></tr>
        ${row("TTFT", u.ttft_ms, "ttft_ms")}${row("TPOT", u.tpot_ms, "tpot_ms")}${row("ITL", u.itl_ms, "itl_ms")}</table>
      <p>${slo}</p>
      ${decisions(u)}
      <div>Output tokens counted exactly: <b data-up="${esc(u.name)}" data-fig="exact_share_pct" data-value="${exact ?? ""}">${fmt(exact)}%</b>, estimated ${fmt(u.estimated_tokens_share_pct)}%
        <div class="share"><div style="width:${exact ?? 0}%"></div></div></div>
      <div>Prompt tokens from the prefix cache: <b data-up="${esc(u.name)}" data-fig="cache_hit_rate_pct" data-value="${u.cache_hit_rate_pct ?? ""}">${u.cache_hit_rate_pct === null || u.cache_hit_rate_pct === undefined ? "not reported by the backend" : fmt(u.cache_hit_rate_pct) + "%"}</b> (${u.cached_input_tokens_total} of ${u.input_tokens_total} since start)</div>
      ${endpoints(u)}
    </div>`;
  });
  $("upstreams").innerHTML = html.join("");
}

// With [tenants]: a row per tenant (its share of the output tokens, which is its share of
// the cost, as a bar), its speed, its waits and its refusals by cause.
function renderTenants(t) {
  $("tenants").hidden = !t;
  if (!t) return;
  const cell = (row, name, value, digits) => `<td data-tenant="${esc(row.tenant)}" data-tfig="${name}" data-value="${value ?? ""}">${fmt(value, digits)}</td>`;
  const refused = (r) =>
    Object.entries(r.refused_by_cause)
      .filter(([, n]) => n > 0)
      .map(([cause, n]) => `${esc(cause.replace(/_/g, " "))} ${n}`)
      .join(", ") || "–";
  const rows = t.top
    .map(
      (r) => `<tr class="tenant" data-tenant="${esc(r.tenant)}"><td>${esc(r.tenant)}</td>
        ${cell(r, "requests_total", r.requests_total, 0)}${cell(r, "output_tokens_total", r.output_tokens_total, 0)}
        <td data-tenant="${esc(r.tenant)}" data-tfig="output_share_pct" data-value="${r.output_share_pct}">${fmt(r.output_share_pct)}%<div class="share"><div style="width:${r.output_share_pct}%"></div></div></td>
        ${cell(r, "output_tps", r.output_tps, 1)}${cell(r, "ttft_ms_p50", r.ttft_ms.p50)}${cell(r, "ttft_ms_p90", r.ttft_ms.p90)}
        ${cell(r, "tpot_ms_p50", r.tpot_ms.p50)}${cell(r, "goodput_pct", r.goodput_pct)}${cell(r, "queue_wait_ms", r.queue_wait_ms)}
        <td data-tenant="${esc(r.tenant)}" data-tfig="refused_total" data-value="${r.refused_total}">${r.refused_total}<div class="key">${refused(r)}</div></td></tr>`,
    )
    .join("");
  const notes = [`${t.tracked} tracked`, `${t.budgets} budget bucket(s)`];
  if (t.invalid_priority_total) notes.push(`${t.invalid_priority_total} request(s) with an unknown priority (served as normal)`);
  $("tenants-table").innerHTML = `<table class="pct tenants"><tr><th>tenant</th><th>requests</th><th>output tokens</th><th>share of output</th><th>output T/s</th><th>TTFT p50</th><th>TTFT p90</th><th>TPOT p50</th><th>% good</th><th>queue wait (ms)</th><th>refused</th></tr>${rows}</table><p class="key">${notes.join(" · ")}</p>`;
}

// Each route's rollout: where it is, to's share (and its shadow copies), the last evaluation.
function renderRollouts(list) {
  const any = Array.isArray(list) && list.length > 0;
  $("rollouts").hidden = !any;
  if (!any) return;
  const rows = list
    .map((r) => {
      const last = r.last ? `${esc(r.last.decision.replace(/_/g, " "))}: ${esc(r.last.reason)}` : "no evaluation yet";
      return `<tr class="rollout" data-route="${esc(r.route)}"><td>${esc(r.route)}</td><td>${esc(r.from)} → ${esc(r.to)}</td>
        <td data-rfig="state" data-value="${esc(r.state)}" class="state-${esc(r.state)}">${esc(r.state.replace(/_/g, " "))}</td>
        <td data-rfig="percent" data-value="${r.percent}">${fmt(r.percent)}%<div class="share"><div style="width:${r.percent}%"></div></div></td>
        <td data-rfig="shadow_percent" data-value="${r.shadow_percent}">${r.shadow_percent > 0 ? fmt(r.shadow_percent) + "%" : "–"}</td>
        <td class="key">${last}</td></tr>`;
    })
    .join("");
  $("rollouts-table").innerHTML = `<table class="pct rollouts"><tr><th>route</th><th>from → to</th><th>state</th><th>to's share</th><th>shadow copies of from's</th><th>last evaluation</th></tr>${rows}</table>`;
}

function renderVerdict(c) {
  if (!c) {
    $("verdict-text").textContent = "no route splits traffic between two upstreams: nothing to compare";
    $("verdict-diffs").innerHTML = "";
    return;
  }
  $("verdict-text").textContent = c.verdict;
  const rows = [
    ["TPOT", c.metrics.tpot_ms, "lower is better"],
    ["TTFT", c.metrics.ttft_ms, "lower is better"],
    ["system T/s", c.metrics.system_tps, "higher is better"],
  ];
  const span = Math.max(5, ...rows.flatMap(([, m]) => (m.ci95_pct ? m.ci95_pct.map(Math.abs) : [0]))) * 1.1;
  const pos = (v) => 50 + (50 * v) / span;
  $("verdict-diffs").innerHTML = rows
    .map(([label, m, better]) => {
      if (m.diff_pct === null) return `<div class="diff"><b>${label}</b><div class="bar"><div class="zero"></div></div><span class="txt">no estimate yet</span></div>`;
      const [lo, hi] = m.ci95_pct;
      return `<div class="diff"><b>${label}: ${esc(c.b)} vs ${esc(c.a)}</b>
        <div class="bar"><div class="zero"></div>
          <div class="ci ${m.significant ? "sig" : ""}" style="left:${pos(lo)}%;width:${Math.max(0.5, pos(hi) - pos(lo))}%"></div>
          <div class="pt" style="left:calc(${pos(m.diff_pct)}% - 1px)"></div></div>
        <span class="txt" data-fig="${label}_diff_pct" data-value="${m.diff_pct}">${m.diff_pct > 0 ? "+" : ""}${fmt(m.diff_pct)}% (95% CI ${fmt(lo)} to ${fmt(hi)}) · ${better}</span></div>`;
    })
    .join("");
}

// ---- charts ----

const CHARTS = [
  ["system", "c-system", "tokens/s"],
  ["single", "c-single", "tokens/s"],
  ["tpot", "c-tpot", "ms per token"],
  ["ttft", "c-ttft", "ms"],
  ["load", "c-load", "requests"],
];

function width(el) {
  return Math.max(300, el.clientWidth || el.parentElement.clientWidth - 28);
}

function buildCharts(names) {
  for (const c of Object.values(state.charts)) c.destroy();
  state.charts = {};
  for (const [id, el, unit] of CHARTS) {
    const series = [{}];
    for (const n of names) {
      const stroke = state.colours.get(n);
      if (id === "tpot" || id === "ttft") {
        series.push({ label: `${n} p50`, stroke, width: 2, spanGaps: true });
        series.push({ label: `${n} p90`, stroke, width: 1.5, dash: [6, 4], spanGaps: true });
      } else if (id === "load") {
        series.push({ label: `${n} in flight`, stroke, width: 2 });
        series.push({ label: `${n} queued`, stroke, width: 1, dash: [2, 3] });
        series.push({ label: `${n} limit`, stroke, width: 1.5, dash: [8, 4], spanGaps: false });
      } else {
        series.push({ label: n, stroke, width: 2, spanGaps: true });
      }
    }
    const opts = {
      width: width($(el)),
      height: 240,
      scales: { x: { time: true } },
      axes: [{ label: "time" }, { label: unit, size: 60 }],
      legend: { live: false },
      series,
    };
    state.charts[id] = new uPlot(opts, series.map(() => []), $(el));
  }
  const series = [{ label: "in flight" }];
  for (const n of names) {
    const stroke = state.colours.get(n);
    series.push({ label: `${n} TPOT p50`, stroke, width: 2, scale: "ms", spanGaps: true });
    series.push({ label: `${n} TPOT p90`, stroke, width: 1.5, dash: [6, 4], scale: "ms", spanGaps: true });
    series.push({ label: `${n} system T/s`, stroke, width: 1, dash: [2, 3], scale: "tps", spanGaps: true });
    series.push({ label: `${n} SLO`, stroke: "#9ca3af", width: 1, dash: [10, 5], scale: "ms", spanGaps: true });
    series.push({ label: `${n} now`, stroke, fill: stroke, scale: "ms", paths: () => null, points: { show: true, size: 11, fill: stroke } });
  }
  state.charts.curve = new uPlot(
    {
      width: width($("c-curve")),
      height: 240,
      scales: { x: { time: false, distr: 3, log: 2 }, ms: { auto: true }, tps: { auto: true } },
      legend: { show: false },
      axes: [
        { label: "requests in flight (log scale)" },
        { scale: "ms", label: "TPOT, ms per token", size: 60 },
        { scale: "tps", label: "system tokens/s", side: 1, size: 60, grid: { show: false } },
      ],
      series,
    },
    series.map(() => []),
    $("c-curve"),
  );
}

function updateCharts(names) {
  const h = state.history;
  const x = h.map((p) => p.t / 1000);
  const col = (n, f) => h.map((p) => {
    const u = p.upstreams.find((u) => u.name === n);
    return u ? f(u) ?? null : null;
  });
  const data = { system: [x], single: [x], tpot: [x], ttft: [x], load: [x] };
  for (const n of names) {
    data.system.push(col(n, (u) => u.system_tps));
    data.single.push(col(n, (u) => u.single_stream_tps));
    data.tpot.push(col(n, (u) => u.tpot_ms.p50), col(n, (u) => u.tpot_ms.p90));
    data.ttft.push(col(n, (u) => u.ttft_ms.p50), col(n, (u) => u.ttft_ms.p90));
    data.load.push(col(n, (u) => u.in_flight), col(n, (u) => u.queued), col(n, (u) => u.limit));
  }
  for (const [id] of CHARTS) state.charts[id].setData(data[id]);
  if (!state.snap) return;
  // The curve: its buckets and each upstream's operating point on one x axis.
  const ups = state.snap.stats.upstreams;
  const xs = new Set();
  for (const u of ups) {
    for (const p of u.curve) if (!p.sparse) xs.add(p.concurrency);
    if (u.concurrency > 0) xs.add(Number(u.concurrency.toFixed(2)));
  }
  const cx = [...xs].sort((a, b) => a - b);
  const curve = [cx];
  for (const n of names) {
    const u = ups.find((u) => u.name === n);
    const at = (f) => cx.map((c) => {
      const p = u && u.curve.find((p) => p.concurrency === c && !p.sparse);
      return p ? f(p) ?? null : null;
    });
    const now = u && u.concurrency > 0 ? Number(u.concurrency.toFixed(2)) : null;
    const nowTpot = u ? (u.tpot_ms.p90 ?? u.tpot_ms.p50) : null;
    curve.push(
      at((p) => p.tpot_ms_p50),
      at((p) => p.tpot_ms_p90),
      at((p) => p.system_tps),
      cx.map(() => (u && u.slo ? u.slo.tpot_ms : null)),
      cx.map((c) => (c === now ? nowTpot : null)),
    );
  }
  state.charts.curve.setData(curve);
}

window.addEventListener("resize", () => {
  for (const c of Object.values(state.charts)) c.setSize({ width: width(c.root.parentElement), height: 240 });
});

start();
