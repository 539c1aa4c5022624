// The coconet dashboard: plain JS over the read-only JSON under /api/v1/dashboard, plots by plotly.
"use strict";

const API = "/api/v1/dashboard";
const LAYOUT = { margin: { t: 36, r: 20, b: 50, l: 70 }, hovermode: "closest", legend: { font: { size: 11 } } };
const CONFIG = { displaylogo: false, responsive: true };

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
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

async function loadPrograms() {
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
    a.append(el("div", { class: "hash" }, `${p.hash.slice(0, 12)} · ${p.results} result${p.results === 1 ? "" : "s"}`));
    const li = el("li");
    li.append(a);
    list.append(li);
  }
  const wanted = location.hash.slice(1);
  const first = programs.find((p) => p.hash === wanted) || programs.find((p) => p.results > 0) || programs[0];
  if (location.hash.slice(1) === first.hash) await loadProgram(first.hash);
  else location.hash = first.hash; // hashchange loads it
}

async function loadProgram(hash) {
  for (const a of document.querySelectorAll("#programs a")) a.classList.toggle("active", a.dataset.hash === hash);
  let view;
  try {
    view = await fetchJSON(`${API}/programs/${encodeURIComponent(hash)}`);
  } catch (e) {
    $("#detail").hidden = true;
    $("#placeholder").hidden = false;
    $("#placeholder").textContent = "could not load this program";
    showError(`program ${hash}`, e);
    return;
  }
  $("#placeholder").hidden = true;
  $("#detail").hidden = false;
  $("#program-title").textContent = `${view.name} (${view.hash.slice(0, 12)})`;
  renderResults(view);
  renderTimings(view);
  renderSpeedups(view);
  renderStudies(view);
  await renderWinners(view);
}

function renderResults(view) {
  const body = $("#results tbody");
  body.replaceChildren();
  if (view.results.length === 0) {
    const td = el("td", { colspan: "11", class: "muted" }, "no winner recorded yet");
    body.append(el("tr")).append(td);
    return;
  }
  view.results.forEach((r, i) => {
    const tr = el("tr", { "data-index": String(i) });
    const ci = r.ci95_s[0] === null ? "–" : `${seconds(r.ci95_s[0])} – ${seconds(r.ci95_s[1])}`;
    const cells = [
      [sizesText(r.sizes)], [r.topology], [String(r.world), "num"], [r.backend],
      [r.sharded.length ? `${r.schedule} (leaves ${r.sharded.join(", ")} sharded)` : r.schedule, "schedule"],
      [r.shardable_words, "shardable"],
      [seconds(r.median_s), "num"], [ci, "num"], [seconds(r.baseline_median_s), "num"],
      [r.speedup === null ? "–" : `${r.speedup.toFixed(2)}×`, "num"], [r.source],
    ];
    for (const [text, cls] of cells) tr.append(el("td", cls ? { class: cls } : {}, text));
    tr.addEventListener("click", () => { $("#winner").value = String(i); showCode(view, i); });
    body.append(tr);
  });
}

function emptyNote(container, text) {
  container.replaceChildren(el("p", { class: "muted" }, text));
}

function renderTimings(view) {
  const box = $("#timings");
  box.replaceChildren();
  if (view.timings.length === 0) return emptyNote(box, "no successful timing recorded yet");
  for (const t of view.timings) {
    const div = el("div", { class: "plot timing-plot", "data-context": t.context });
    box.append(div);
    const traces = t.series.map((s) => ({
      type: "scatter", mode: "lines+markers", name: s.name, x: s.x, y: s.median_s,
      hovertemplate: `%{y:.3s}s at ${t.dims}=%{x}<extra>${s.name.replace(/</g, "&lt;")}</extra>`,
    }));
    const more = t.schedules > t.shown ? ` (${t.shown} of ${t.schedules} schedules)` : "";
    const legendHeight = 24 * traces.length;
    div.style.height = `${400 + legendHeight}px`; // a responsive plot takes its height from its div
    Plotly.newPlot(div, traces, {
      ...LAYOUT, title: { text: `${t.context}${more}`, font: { size: 13 } },
      height: 400 + legendHeight, margin: { ...LAYOUT.margin, b: 90 + legendHeight },
      // schedule texts are long: the legend goes under the plot, where it can use the full width
      legend: { orientation: "h", x: 0, y: -0.2, yanchor: "top", yref: "paper", font: { size: 11 } },
      xaxis: { type: "log", title: { text: `${t.dims} (elements)` } },
      yaxis: { type: "log", title: { text: "median time per step (s)" } },
    }, CONFIG);
  }
}

function renderSpeedups(view) {
  const box = $("#speedups");
  box.replaceChildren();
  if (view.speedups.length === 0) return emptyNote(box, "no speed-up recorded yet (a winner needs a timed baseline)");
  const div = el("div", { class: "plot", id: "speedup-plot" });
  box.append(div);
  const traces = view.speedups.map((s) => ({
    type: "scatter", mode: "lines+markers", name: s.context, x: s.x, y: s.speedup, text: s.schedule,
    hovertemplate: "%{y:.2f}× at %{x}<br>%{text}<extra>%{fullData.name}</extra>",
  }));
  const xs = view.speedups.flatMap((s) => s.x);
  traces.push({ type: "scatter", mode: "lines", name: "baseline (1×)", x: [Math.min(...xs), Math.max(...xs)],
                y: [1, 1], line: { dash: "dot", color: "#999" }, hoverinfo: "skip" });
  Plotly.newPlot(div, traces, {
    ...LAYOUT, title: { text: "winner vs baseline per topology", font: { size: 13 } },
    xaxis: { type: "log", title: { text: "size (elements)" } },
    yaxis: { title: { text: "speed-up (baseline time / winner time)" }, rangemode: "tozero" },
  }, CONFIG);
}

function renderStudies(view) {
  const select = $("#study");
  select.replaceChildren();
  const box = $("#history");
  if (view.studies.length === 0) {
    select.hidden = true;
    return emptyNote(box, "no tuning job recorded for this program");
  }
  select.hidden = false;
  view.studies.forEach((s, i) => {
    const label = `job ${s.job_id} · ${sizesText(s.sizes)} · ${s.topology} · ${s.world} ranks · ${s.trials.length} trials` +
      (s.state ? ` · ${s.state}` : "");
    select.append(el("option", { value: String(i) }, label));
  });
  select.onchange = () => plotHistory(view.studies[Number(select.value)]);
  plotHistory(view.studies[0]);
}

function plotHistory(study) {
  const box = $("#history");
  box.replaceChildren();
  if (study.trials.length === 0) return emptyNote(box, "this job has no recorded trial yet");
  const div = el("div", { class: "plot", id: "history-plot" });
  box.append(div);
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
  Plotly.newPlot(div, traces, {
    ...LAYOUT, title: { text: `job ${study.job_id}: ${sizesText(study.sizes)} on ${study.topology}`, font: { size: 13 } },
    xaxis: { title: { text: "trial (in the order measured)" }, dtick: 1 },
    yaxis: { type: "log", title: { text: "median time per step (s)" } },
  }, CONFIG);
}

async function renderWinners(view) {
  const select = $("#winner");
  select.replaceChildren();
  const code = $("#code code");
  if (view.results.length === 0) {
    select.hidden = true;
    code.textContent = "no winner recorded yet";
    return;
  }
  select.hidden = false;
  view.results.forEach((r, i) => {
    select.append(el("option", { value: String(i) }, `${sizesText(r.sizes)} · ${r.context} · ${r.schedule}`));
  });
  select.onchange = () => showCode(view, Number(select.value));
  // The largest tuned size first: the one a user most likely deploys.
  const last = view.results.length - 1;
  select.value = String(last);
  await showCode(view, last);
}

async function showCode(view, i) {
  const r = view.results[i];
  const code = $("#code code");
  code.textContent = "loading…";
  const url = `${API}/programs/${encodeURIComponent(view.hash)}/code?measurement=${r.measurement_id}`;
  try {
    code.textContent = await fetchJSON(url, true);
  } catch (e) {
    code.textContent = "could not load the generated code";
    showError(`code of ${r.schedule}`, e);
  }
}

window.addEventListener("hashchange", () => loadProgram(location.hash.slice(1)).catch((e) => showError("dashboard", e)));
window.addEventListener("DOMContentLoaded", () => {
  if (typeof Plotly === "undefined") showError("plots", "plotly.min.js did not load from /static/plotly.min.js");
  loadPrograms().catch((e) => showError("dashboard", e));
});
