// The coconet dashboard: plain JS over the read-only JSON under /api/v1/dashboard, plots by plotly.
// The address says what is shown (#<program>?topology=…&world=…&backend=…&source=…&offset=…), so a view
// can be shared; the winners table is paged by the server and plots are drawn as they scroll into view.
"use strict";

const API = "/api/v1/dashboard";
const PAGE = 25;
const POLL_MS = 3000;
const NEAR_PX = 300; // a plot this close below the viewport is drawn before it scrolls in
const FILTERS = ["topology", "world", "backend", "source"];
const LAYOUT = { margin: { t: 36, r: 20, b: 50, l: 70 }, hovermode: "closest", legend: { font: { size: 11 } } };
const CONFIG = { displaylogo: false, responsive: true };
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf", "#393b79", "#ad494a"];

const $ = (sel) => document.querySelector(sel);
// What the page shows now; every render reads it, navigation and the poll change it.
const state = { hash: null, summary: null, filterKey: null, query: null, offset: 0, page: null, version: null,
                busy: false };
// Browser-side timings of each load (read by the tests): data fetched, then rendered and painted.
window.coconetTimings = [];

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

// plotly.min.js is 4.8 MB of script, whose parsing holds the page for a second or more on a slow machine: the
// page asks for it once the table is on screen, so only the plots wait for it. (Preloaded, it competed with the
// table's own requests: a cold server's first compression of it delayed them, and the table painted at 1.0-1.07 s
// after navigation start on a quiet 2-core machine against 0.75-0.87 s without.)
let plotly = null;

function loadPlotly() {
  plotly ??= new Promise((resolve, reject) => {
    const script = el("script", { src: "/static/plotly.min.js" });
    script.onload = resolve;
    script.onerror = () => reject(new Error("plotly.min.js did not load from /static/plotly.min.js"));
    document.head.append(script);
  });
  return plotly;
}

// Every failed fetch ends up here: the page says what went wrong instead of staying blank.
function showError(what, err) {
  const box = $("#error");
  const line = `${what}: ${err && err.message ? err.message : err}`;
  box.textContent = box.hidden ? line : `${box.textContent}\n${line}`;
  box.hidden = false;
}

async function fetchJSON(url, asText = false) {
  let resp;
  try {
    resp = await fetch(url, { headers: { Accept: asText ? "text/plain" : "application/json" } });
  } catch (e) {
    throw new Error(`the server did not answer (${e.message})`);
  }
  if (!resp.ok) {
    let detail = resp.statusText;
    try {
      const body = await resp.json();
      detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail ?? body);
    } catch (_) { /* not JSON: keep the status text */ }
    throw new Error(`HTTP ${resp.status}: ${detail}`);
  }
  return asText ? resp.text() : resp.json();
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return `${(s * 1e6).toFixed(1)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(2)} ms`;
  return `${s.toFixed(3)} s`;
}

function sizesText(sizes) {
  return Object.entries(sizes).map(([k, v]) => `${k}=${v}`).join(",");
}

function painted() {
  return new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
}

// -- the address

function parseAddress() {
  const [hash, query = ""] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(query);
  const filters = new URLSearchParams();
  for (const f of FILTERS) if (params.get(f)) filters.set(f, params.get(f));
  return { hash, filters, offset: Math.max(0, Number(params.get("offset")) || 0) };
}

function go(hash, filters, offset = 0) {
  const params = new URLSearchParams(filters);
  if (offset) params.set("offset", String(offset));
  const q = params.toString();
  location.hash = q ? `${hash}?${q}` : hash; // hashchange shows it
}

// -- programs

async function loadPrograms(navigate = true) {
  const list = $("#programs");
  let programs;
  try {
    programs = await fetchJSON(`${API}/programs`);
  } catch (e) {
    list.replaceChildren(el("li", { class: "muted" }, "could not load the programs"));
    showError("programs", e);
    return;
  }
  list.replaceChildren();
  if (programs.length === 0) {
    list.append(el("li", { class: "muted" }, "no programs in the store yet"));
    return;
  }
  for (const p of programs) {
    const a = el("a", { href: `#${p.hash}`, "data-hash": p.hash }, p.name);
    a.classList.toggle("active", p.hash === state.hash);
    a.append(el("div", { class: "hash" }, `${p.hash.slice(0, 12)} · ${p.results} result${p.results === 1 ? "" : "s"}`));
    list.appendChild(el("li")).append(a);
  }
  if (!navigate) return;
  const wanted = parseAddress().hash;
  const first = programs.find((p) => p.hash === wanted) || programs.find((p) => p.results > 0) || programs[0];
  if (wanted === first.hash) await show("first");
  else go(first.hash, new URLSearchParams()); // hashchange shows it
}

// -- one program's view

// The table first, then the plots: the plots' data reuses what the table's query read, and the table shows
// before the plots' data has arrived.
async function show(what, force = false) {
  const start = what === "first" ? 0 : performance.now();
  const { hash, filters, offset } = parseAddress();
  const key = filters.toString();
  const programChanged = hash !== state.hash;
  const filtersChanged = programChanged || key !== state.filterKey || force;
  for (const a of document.querySelectorAll("#programs a")) a.classList.toggle("active", a.dataset.hash === hash);
  const h = encodeURIComponent(hash);
  const page = new URLSearchParams(filters);
  page.set("limit", String(PAGE));
  page.set("offset", String(offset));
  let summary, winners, plots, studies;
  const failed = (e) => {
    $("#detail").hidden = true;
    $("#placeholder").hidden = false;
    $("#placeholder").textContent = "could not load this program";
    showError(`program ${hash}`, e);
  };
  try {
    [summary, winners] = await Promise.all([
      programChanged || force ? fetchJSON(`${API}/programs/${h}`) : state.summary,
      fetchJSON(`${API}/programs/${h}/winners?${page}`),
    ]);
  } catch (e) {
    return failed(e);
  }
  const tableFetched = performance.now();
  Object.assign(state, { hash, summary, filterKey: key, query: filters, offset, page: winners });
  $("#placeholder").hidden = true;
  $("#detail").hidden = false;
  $("#program-title").textContent = `${summary.name} (${summary.hash.slice(0, 12)})`;
  renderFilters(summary.facets, filters);
  renderResults(winners);
  await painted();
  const table = performance.now();
  let fetched = table, rendered = table;
  if (filtersChanged) {
    try {
      [plots, studies] = await Promise.all([fetchJSON(`${API}/programs/${h}/plots?${filters}`),
                                            fetchJSON(`${API}/programs/${h}/studies?${filters}`)]);
    } catch (e) {
      return failed(e);
    }
    try {
      await loadPlotly();
    } catch (e) {
      return showError("plots", e);
    }
    fetched = performance.now();
    drawing = [];
    renderSpeedups(plots.speedups);
    renderTimings(plots);
    renderStudies(studies);
    await Promise.all(drawing);
    await painted();
    rendered = performance.now();
  }
  // render_ms: the page's own work once its data had arrived (the table's, then the plots')
  window.coconetTimings.push({ what, start, table, fetched, rendered, total_ms: rendered - start,
                               render_ms: (table - tableFetched) + (rendered - fetched) });
  renderWinners(winners);
}

function renderFilters(facets, filters) {
  for (const f of FILTERS) {
    const select = $(`#filter-${f}`);
    select.replaceChildren(el("option", { value: "" }, "all"));
    for (const v of facets[f]) select.append(el("option", { value: String(v) }, String(v)));
    select.value = filters.get(f) || "";
    select.onchange = () => {
      const next = new URLSearchParams(state.query);
      if (select.value) next.set(f, select.value);
      else next.delete(f);
      go(state.hash, next);
    };
  }
}

function renderResults(page) {
  const body = $("#results tbody");
  body.replaceChildren();
  const last = Math.min(page.offset + page.rows.length, page.total);
  $("#page-info").textContent = page.total === 0 ? "no winner" :
    `${page.offset + 1}–${last} of ${page.total.toLocaleString("en")}`;
  $("#prev").disabled = page.offset === 0;
  $("#next").disabled = last >= page.total;
  $("#prev").onclick = () => go(state.hash, state.query, Math.max(0, page.offset - PAGE));
  $("#next").onclick = () => go(state.hash, state.query, page.offset + PAGE);
  if (page.rows.length === 0) {
    const td = el("td", { colspan: "11", class: "muted" },
                  page.total ? "no row on this page" : "no winner recorded yet (for these filters)");
    body.appendChild(el("tr")).append(td);
    return;
  }
  page.rows.forEach((r, i) => {
    const tr = el("tr", { "data-index": String(i), class: r.source });
    const ci = r.ci95_s[0] === null ? "–" : `${seconds(r.ci95_s[0])} – ${seconds(r.ci95_s[1])}`;
    const cells = [
      [sizesText(r.sizes)], [r.topology], [String(r.world), "num"], [r.backend],
      [r.sharded.length ? `${r.schedule} (leaves ${r.sharded.join(", ")} sharded)` : r.schedule, "schedule", true],
      [r.shardable_words, "shardable"],
      [seconds(r.median_s), "num"], [ci, "num"], [seconds(r.baseline_median_s), "num"],
      [r.speedup === null ? "–" : `${r.speedup.toFixed(2)}×`, "num"], [r.source, "source"],
    ];
    // a long schedule shows in full on hover, so that a page of rows stays a screen high
    for (const [text, cls, clipped] of cells) {
      const td = tr.appendChild(el("td", cls ? { class: cls } : {}, clipped ? "" : text));
      if (clipped) td.append(el("div", { class: "clip", title: text }, text));
    }
    tr.addEventListener("click", () => { $("#winner").value = String(i); showCode(page.rows[i]); });
    body.append(tr);
  });
}

function emptyNote(container, text) {
  container.replaceChildren(el("p", { class: "muted" }, text));
}

// -- plots, drawn when they come near the viewport: a filter leaving fifty plots draws the few on screen

const pending = new Map();
const observer = new IntersectionObserver((entries) => {
  for (const entry of entries) if (entry.isIntersecting) draw(entry.target);
}, { rootMargin: `${NEAR_PX}px` });
// the plots of the render under way that were drawn at once (on screen): show() waits for them
let drawing = [];

function draw(div) {
  if (!pending.has(div)) return null;
  const [traces, layout] = pending.get(div);
  pending.delete(div);
  observer.unobserve(div);
  return Plotly.newPlot(div, traces, layout, CONFIG);
}

function plotLater(box, div, traces, layout) {
  div.style.height = `${layout.height || 400}px`; // a responsive plot takes its height from its div
  box.append(div);
  pending.set(div, [traces, layout]);
  const top = div.getBoundingClientRect().top;
  if (top < window.innerHeight + NEAR_PX) drawing.push(draw(div));
  else observer.observe(div);
}

function clearPlots(box) {
  for (const div of box.querySelectorAll(".plot")) {
    pending.delete(div);
    observer.unobserve(div);
    if (div.classList.contains("js-plotly-plot")) Plotly.purge(div);
  }
  box.replaceChildren();
}

// Measured and predicted differ in line and marker; one schedule keeps its colour in both. A line of many
// points draws no markers: thousands of SVG nodes would slow the page and hide the dashes.
const MAX_MARKERS = 60;

function styled(trace, source, colour) {
  const predicted = source === "predicted";
  return { ...trace, mode: trace.x.length > MAX_MARKERS ? "lines" : "lines+markers",
           line: { dash: predicted ? "dash" : "solid", color: colour },
           marker: { symbol: predicted ? "circle-open" : "circle", size: predicted ? 8 : 6, color: colour } };
}

function colours() {
  const seen = new Map();
  return (key) => {
    if (!seen.has(key)) seen.set(key, PALETTE[seen.size % PALETTE.length]);
    return seen.get(key);
  };
}

function legendBelow(names) {
  // a horizontal legend puts as many entries on a row as fit in the plot's width (about 1,100 px here)
  const widest = Math.max(...names.map((n) => n.length), 1);
  const perRow = Math.max(1, Math.floor(1100 / (widest * 6.5 + 45)));
  const legendHeight = 22 * Math.ceil(names.length / perRow);
  // schedule texts are long: the legend goes under the plot, where it can use the full width
  return { height: 400 + legendHeight, margin: { ...LAYOUT.margin, b: 90 + legendHeight },
           legend: { orientation: "h", x: 0, y: -0.2, yanchor: "top", yref: "paper", font: { size: 11 } } };
}

function renderSpeedups(speedups) {
  const box = $("#speedups");
  clearPlots(box);
  if (speedups.length === 0) return emptyNote(box, "no speed-up recorded yet (a winner needs a timed baseline)");
  speedups.forEach((p, i) => {
    const colour = colours();
    const traces = p.series.map((s) => styled({
      type: "scatter", mode: "lines+markers", name: s.name, x: s.x, y: s.speedup, text: s.schedule,
      hovertemplate: `%{y:.2f}× at ${p.axis.title}=%{x}<br>%{text}<extra>%{fullData.name}</extra>`,
    }, s.source, colour(s.context)));
    const more = p.contexts > p.series.length ? ` (${p.series.length} of ${p.contexts} series: narrow the filters)` : "";
    const div = el("div", { class: "plot speedup-plot", "data-family": p.family, id: i === 0 ? "speedup-plot" : "" });
    plotLater(box, div, traces, {
      ...LAYOUT, ...legendBelow(traces.map((t) => t.name)),
      title: { text: `speed-up · ${p.family}${more}`, font: { size: 13 } },
      xaxis: { type: p.axis.type, title: { text: p.axis.title } },
      yaxis: { title: { text: "speed-up (baseline time / winner time)" }, rangemode: "tozero" },
      shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { dash: "dot", color: "#999" } }],
    });
  });
}

function renderTimings(plots) {
  const box = $("#timings");
  clearPlots(box);
  if (plots.timings.length === 0) return emptyNote(box, "no successful timing recorded yet");
  if (plots.timings_total > plots.timings.length) {
    box.append(el("p", { class: "muted" },
                  `${plots.timings.length} of ${plots.timings_total} plots: narrow the filters to see the others`));
  }
  for (const t of plots.timings) {
    const colour = colours();
    const traces = t.series.map((s) => styled({
      type: "scatter", mode: "lines+markers", name: s.name, x: s.x, y: s.median_s,
      hovertemplate: `%{y:.3s}s at ${t.axis.title}=%{x}<extra>${s.name.replace(/</g, "&lt;")}</extra>`,
    }, s.source, colour(`${s.backend}: ${s.schedule}`)));
    const more = t.schedules > t.shown ? ` (${t.shown} of ${t.schedules} schedules)` : "";
    const div = el("div", { class: "plot timing-plot", "data-context": t.context, "data-family": t.family });
    plotLater(box, div, traces, {
      ...LAYOUT, ...legendBelow(traces.map((t) => t.name)),
      title: { text: `${t.context} · ${t.family}${more}`, font: { size: 13 } },
      xaxis: { type: t.axis.type, title: { text: t.axis.title } },
      yaxis: { type: "log", title: { text: "median time per step (s)" } },
    });
  }
}

// -- trial history and code

function renderStudies(studies) {
  const select = $("#study");
  select.replaceChildren();
  const box = $("#history");
  clearPlots(box);
  if (studies.length === 0) {
    select.hidden = true;
    return emptyNote(box, "no tuning job recorded for these filters");
  }
  select.hidden = false;
  for (const s of studies) {
    const label = `job ${s.job_id} · ${sizesText(s.sizes)} · ${s.topology} · ${s.world} ranks · ${s.done} trials` +
      ` · ${s.state}`;
    select.append(el("option", { value: String(s.job_id) }, label));
  }
  select.onchange = () => loadStudy(select.value);
  loadStudy(select.value);
}

async function loadStudy(jobId) {
  const box = $("#history");
  let study;
  try {
    study = await fetchJSON(`${API}/programs/${encodeURIComponent(state.hash)}/studies/${jobId}`);
  } catch (e) {
    return showError(`job ${jobId}`, e);
  }
  clearPlots(box);
  if (study.trials.length === 0) return emptyNote(box, "this job has no recorded trial yet");
  const ok = [], failed = [], best = { x: [], y: [] };
  let bestSoFar = Infinity;
  study.trials.forEach((t, i) => {
    if (t.status === "ok" && t.median_s) {
      ok.push([i + 1, t.median_s, t.schedule]);
      bestSoFar = Math.min(bestSoFar, t.median_s);
    } else {
      failed.push([i + 1, t.status, `${t.schedule}: ${t.error || t.status}`]);
    }
    if (bestSoFar < Infinity) { best.x.push(i + 1); best.y.push(bestSoFar); }
  });
  const traces = [
    { type: "scatter", mode: "markers", name: "trial", x: ok.map((p) => p[0]), y: ok.map((p) => p[1]),
      text: ok.map((p) => p[2]), hovertemplate: "trial %{x}: %{y:.3s}s<br>%{text}<extra></extra>" },
    { type: "scatter", mode: "lines", name: "best so far", x: best.x, y: best.y, line: { shape: "hv" } },
  ];
  if (failed.length) {
    // A failure has no time: its marker sits on the slowest timing so it shows without skewing the axis.
    const top = ok.length ? Math.max(...ok.map((p) => p[1])) : 1;
    traces.push({ type: "scatter", mode: "markers", name: "failed", x: failed.map((p) => p[0]),
                  y: failed.map(() => top), text: failed.map((p) => p[2]), marker: { symbol: "x", color: "#c0392b" },
                  hovertemplate: "trial %{x} failed<br>%{text}<extra></extra>" });
  }
  plotLater(box, el("div", { class: "plot", id: "history-plot" }), traces, {
    ...LAYOUT, title: { text: `job ${study.job_id}: ${sizesText(study.sizes)} on ${study.topology}`, font: { size: 13 } },
    xaxis: { title: { text: "trial (in the order measured)" }, dtick: 1 },
    yaxis: { type: "log", title: { text: "median time per step (s)" } },
  });
}

function renderWinners(page) {
  const select = $("#winner");
  select.replaceChildren();
  const code = $("#code code");
  if (page.rows.length === 0) {
    select.hidden = true;
    code.textContent = "no winner recorded yet";
    return;
  }
  select.hidden = false;
  page.rows.forEach((r, i) => {
    select.append(el("option", { value: String(i) }, `${sizesText(r.sizes)} · ${r.context} · ${r.schedule}`));
  });
  select.onchange = () => showCode(page.rows[Number(select.value)]);
  select.value = "0";
  showCode(page.rows[0]);
}

async function showCode(r) {
  const code = $("#code code");
  code.textContent = "loading…";
  const url = `${API}/programs/${encodeURIComponent(state.hash)}/code?measurement=${r.measurement_id}`;
  try {
    code.textContent = await fetchJSON(url, true);
  } catch (e) {
    code.textContent = "could not load the generated code";
    showError(`code of ${r.schedule}`, e);
  }
}

// -- live refresh: a cheap version poll; the view is fetched again only when it changed

async function poll() {
  if (document.hidden || state.busy) return;
  state.busy = true;
  try {
    const v = await fetchJSON(`${API}/version`);
    $("#live").textContent = v.running || v.queued ? `live · ${v.running} running, ${v.queued} queued` :
      `up to date · ${new Date().toLocaleTimeString()}`;
    if (state.version !== null && v.version !== state.version && state.hash) {
      await loadPrograms(false);
      await show("refresh", true);
    }
    state.version = v.version;
  } catch (e) {
    $("#live").textContent = `not updating: ${e.message}`;
  } finally {
    state.busy = false;
  }
}

window.addEventListener("hashchange", () => {
  const { hash, filters } = parseAddress();
  const what = state.hash === null ? "first" : hash !== state.hash ? "program" :
    filters.toString() !== state.filterKey ? "filter" : "page";
  show(what).catch((e) => showError("dashboard", e));
});
window.addEventListener("DOMContentLoaded", () => {
  loadPrograms().catch((e) => showError("dashboard", e));
  poll();
  setInterval(poll, POLL_MS);
});
