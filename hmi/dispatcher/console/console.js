// The HMI console: reads the HTTP API with the token typed in (kept in this page's memory only).
"use strict";

const state = { token: null, me: null, view: "tenants", timer: null, tenants: [] };
const $ = (id) => document.getElementById(id);

async function api(method, path, body) {
  const opts = { method, headers: { Authorization: `Bearer ${state.token}` } };
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const resp = await fetch(path, opts);
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const err = (data && data.error) || { code: "http_error", message: resp.statusText };
    throw new Error(`${resp.status} ${err.code}: ${err.message}`);
  }
  return data;
}

function cell(text, cls) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text); else td.textContent = text ?? "";
  if (cls) td.className = cls;
  return td;
}

function fill(tableId, rows) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    tr.append(...cells);
    return tr;
  }));
}

function showError(err) {
  $("error").hidden = !err;
  $("error").textContent = err ? String(err.message || err) : "";
}

function adapterOf(spec) {
  if (!spec) return "";
  if (spec.head === "lm") return `LoRA r=${spec.rank}`;
  const sites = (spec.targets || ["q", "v"]).join("+");
  const size = spec.kind === "lora" ? ` r=${spec.rank} on ${sites}` : spec.kind === "bottleneck" ? ` /${spec.reduction_factor}` : "";
  return `${spec.kind}${size}, ${spec.head} (${(spec.labels || []).length} labels)`;
}

async function loadTenants() {
  const list = state.me === "admin" ? (await api("GET", "/v1/tenants")).tenants
                                    : [await api("GET", `/v1/tenants/${state.me}`)];
  state.tenants = list;
  fill("tenants", list.map((t) => [
    cell(t.name), cell(t.model || "encoder"), cell(t.state, `state-${t.state}`), cell(t.domain),
    cell(adapterOf(t.spec)), cell(t.residency, `tier-${t.residency}`), cell(t.requests, "num"),
    cell(t.latency_ms == null ? "" : `${t.latency_ms} ms`, "num"), cell(t.version, "num"),
  ]));
  const select = $("try-tenant");
  const keep = select.value;
  select.replaceChildren(...list.filter((t) => t.state === "ready" || t.state === "updating").map((t) => {
    const o = document.createElement("option");
    o.value = t.name;
    o.textContent = `${t.name} (${t.model || "encoder"})`;
    o.dataset.model = t.model || "encoder";
    return o;
  }));
  if (keep) select.value = keep;
}

async function loadDomains() {
  const { domains } = await api("GET", "/v1/domains");
  fill("domains", domains.map((d) => [
    cell("\u00a0\u00a0".repeat(d.depth || 0) + d.name), cell(d.parent || "\u2014"), cell(d.alpha, "num"),
    cell((d.plot && d.plot.entries) ?? "", "num"),
    cell(d.plot && d.plot.file_bytes ? `${(d.plot.file_bytes / 2 ** 20).toFixed(1)} MiB` : "", "num"),
    cell(d.tenants, "num"),
  ]));
}

async function loadJobs() {
  let jobs;
  if (state.me === "admin") {
    jobs = (await api("GET", "/v1/jobs")).jobs;
  } else {
    const t = await api("GET", `/v1/tenants/${state.me}`);
    jobs = t.job ? [await api("GET", `/v1/jobs/${t.job}`)] : [];
  }
  jobs.sort((a, b) => (b.created || 0) - (a.created || 0));
  fill("jobs", jobs.map((j) => {
    const bar = document.createElement("progress");
    bar.max = 1;
    bar.value = j.progress || 0;
    const pct = document.createElement("span");
    pct.textContent = ` ${Math.round(100 * (j.progress || 0))}%`;
    const wrap = document.createElement("span");
    wrap.append(bar, pct);
    return [cell(j.id), cell(j.kind), cell(j.tenant || j.domain), cell(j.state, `state-${j.state}`), cell(wrap),
            cell((j.info && j.info.stage) || "")];
  }));
}

// -- the Server view: charts of the server's own metrics over time, drawn as SVG -------------------
const HISTORY_S = 3600; // the span drawn: the server's last hour (GET /v1/metrics/history), then a sample a second
const INFERENCE = /^\/v1\/(tenants\/\{tenant\}\/(infer|generate)|embeddings|completions)$/;
const COLORS = ["#295fa6", "#1b7f3b", "#b3261e", "#8a5a00", "#7b3fa6", "#00808a", "#c2571a", "#4a5563"];
const samples = [];

function parseMetrics(text) {
  // Prometheus text format -> [{name, labels, value}]
  const out = [];
  for (const line of text.split("\n")) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m || line.startsWith("#")) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

function snapshot(metrics, running, t) {
  // One sample: cumulative counts the charts turn into rates, and each running job's progress
  // (running: {"<kind> <tenant or domain>": progress}, as the server's history keeps it).
  const s = { t, requests: 0, buckets: {}, plot: {}, tiers: {}, jobs: { ...running } };
  for (const { name, labels, value } of metrics) {
    if (name === "hmi_http_requests_total" && INFERENCE.test(labels.route)) s.requests += value;
    else if (name === "hmi_http_request_seconds_bucket" && INFERENCE.test(labels.route)) {
      s.buckets[labels.le] = (s.buckets[labels.le] || 0) + value;
    } else if (name === "hmi_plot_hits_total" && labels.level !== "hot") {
      s.plot[`${labels.domain} ${labels.level.split(":")[0]}`] =
        (s.plot[`${labels.domain} ${labels.level.split(":")[0]}`] || 0) + value;
    } else if (name === "hmi_adapter_residency_total") s.tiers[labels.tier] = value;
  }
  return s;
}

function rate(a, b, key, sub) {
  const dt = b.t - a.t;
  const va = sub ? (a[key][sub] || 0) : a[key], vb = sub ? (b[key][sub] || 0) : b[key];
  return dt > 0 ? Math.max(0, (vb - va) / dt) : 0; // a counter that restarted reads 0, not negative
}

function quantile(a, b, q) {
  // The q-quantile (ms) of the requests between samples a and b, from their histogram buckets.
  const keys = Object.keys(b.buckets).sort((x, y) => Number(x) - Number(y)); // "0.005" ... "10.0", "+Inf"
  const les = keys.map(Number);
  const counts = keys.map((k) => Math.max(0, (b.buckets[k] || 0) - (a.buckets[k] || 0)));
  const total = counts[counts.length - 1] || 0;
  if (!total) return null;
  const target = q * total;
  let prevLe = 0, prevCount = 0;
  for (let i = 0; i < les.length; i++) {
    if (counts[i] >= target) {
      if (les[i] === Infinity) return prevLe * 1000;
      const within = counts[i] - prevCount;
      return 1000 * (prevLe + (les[i] - prevLe) * (within ? (target - prevCount) / within : 1));
    }
    prevLe = les[i];
    prevCount = counts[i];
  }
  return null;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function niceMax(v) {
  // The top of a y axis for values up to v: the smallest of 1, 2, 5 x 10^k at or above it; 1 when
  // every value is 0 (an empty chart reads 0 to 1, not 0 to a billionth).
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => +(m * p).toPrecision(12)).find((m) => m >= v);
}

function axisLabel(v) {
  // 0, 0.5, 25, 1.5k, 2e-4: short, and never a float's rounding noise.
  if (v === 0) return "0";
  if (Math.abs(v) >= 1000) return `${+(v / 1000).toPrecision(3)}k`;
  if (Math.abs(v) < 0.01) return v.toExponential(0);
  return `${+v.toPrecision(3)}`;
}

function draw(id, series, unit) {
  // series: {name: [[t, value], ...]} -> lines over the sampled span, a y axis from 0, a legend.
  const svg = $(id);
  const W = 560, H = 190, L = 48, R = 150, T = 8, B = 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const points = Object.values(series).flat().filter((p) => p[1] != null);
  const t1 = Date.now() / 1000, t0 = Math.min(t1 - 60, ...points.map((p) => p[0]));
  const ymax = unit === "%" ? 100 : niceMax(Math.max(0, ...points.map((p) => p[1])) * 1.1);
  const x = (t) => L + ((t - t0) / Math.max(1, t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);
  const kids = [];
  for (const f of [0, 0.5, 1]) {
    kids.push(svgEl("line", { x1: L, x2: W - R, y1: y(f * ymax), y2: y(f * ymax), class: "grid" }));
    const label = svgEl("text", { x: L - 4, y: y(f * ymax) + 4, "text-anchor": "end" });
    label.textContent = `${axisLabel(f * ymax)}${unit === "%" ? "%" : ""}`;
    kids.push(label);
  }
  const span = svgEl("text", { x: L, y: H - 6 });
  span.textContent = `last ${Math.round((t1 - t0) / 60 * 10) / 10} min`;
  kids.push(span);
  Object.entries(series).forEach(([name, pts], i) => {
    const color = COLORS[i % COLORS.length];
    const drawn = pts.filter((p) => p[1] != null);
    if (drawn.length) {
      kids.push(svgEl("polyline", { points: drawn.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "),
                                    stroke: color, "data-series": name }));
    }
    const key = svgEl("text", { x: W - R + 10, y: T + 12 + 14 * i, fill: color, class: "legend" });
    key.textContent = name;
    kids.push(key);
  });
  svg.replaceChildren(...kids);
}

async function loadHistory() {
  // The server's own samples of the last hour, so the charts start full rather than empty.
  const { samples: past } = await api("GET", "/v1/metrics/history");
  for (const p of past) {
    samples.push(snapshot(p.metrics.map(([name, labels, value]) => ({ name, labels, value })), p.jobs, p.t));
  }
}

async function loadServer() {
  if (!samples.length) await loadHistory();
  const resp = await fetch("/metrics");
  const [metrics, jobs] = [parseMetrics(await resp.text()), (await api("GET", "/v1/jobs")).jobs];
  const running = {};
  for (const j of jobs) if (j.state === "running") running[`${j.kind} ${j.tenant || j.domain}`] = j.progress || 0;
  samples.push(snapshot(metrics, running, Date.now() / 1000));
  while (samples.length && samples[0].t < Date.now() / 1000 - HISTORY_S) samples.shift();
  const pairs = samples.slice(1).map((b, i) => [samples[i], b]);
  const names = (key) => [...new Set(samples.flatMap((s) => Object.keys(s[key])))].sort();
  const rates = (key) => Object.fromEntries(names(key).map((n) => [n, pairs.map(([a, b]) => [b.t, rate(a, b, key, n)])]));
  draw("chart-rps", { "requests/s": pairs.map(([a, b]) => [b.t, rate(a, b, "requests")]) }, "");
  const windowed = samples.map((b, i) => [samples[Math.max(0, i - 10)], b]).slice(1);
  draw("chart-latency", { p50: windowed.map(([a, b]) => [b.t, quantile(a, b, 0.5)]),
                          p99: windowed.map(([a, b]) => [b.t, quantile(a, b, 0.99)]) }, "ms");
  draw("chart-plot", rates("plot"), "");
  draw("chart-tiers", rates("tiers"), "");
  draw("chart-jobs", Object.fromEntries(names("jobs").map((n) => [n, samples.map((s) => [s.t, n in s.jobs ? 100 * s.jobs[n] : null])])), "%");
}

const loaders = { tenants: loadTenants, domains: loadDomains, jobs: loadJobs, server: loadServer, try: loadTenants };

async function refresh() {
  try {
    await loaders[state.view]();
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    showError(null);
  } catch (err) {
    showError(err);
  }
}

function show(view) {
  state.view = view;
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.view === view);
  for (const s of document.querySelectorAll(".view")) s.hidden = s.id !== `view-${view}`;
  clearInterval(state.timer);
  refresh();
  if (view !== "try") state.timer = setInterval(refresh, 1000);
}

async function connect(ev) {
  ev.preventDefault();
  state.token = $("token").value.trim();
  try {
    state.me = (await api("GET", "/v1/me")).caller;
  } catch (err) {
    state.me = null;
    $("tabs").hidden = true;
    showError(err);
    return;
  }
  $("who").textContent = state.me === "admin" ? "connected as the admin" : `connected as tenant ${state.me}`;
  for (const b of document.querySelectorAll("#tabs [data-admin]")) b.hidden = state.me !== "admin";
  $("tabs").hidden = false;
  show("tenants");
}

function resultTable(rows) {
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th>input</th><th>answer</th></tr></thead>";
  const body = document.createElement("tbody");
  for (const [input, answer] of rows) {
    const tr = document.createElement("tr");
    tr.append(cell(input), cell(answer));
    body.append(tr);
  }
  table.append(body);
  return table;
}

function describe(out) {
  if (out.label !== undefined) {
    const p = out.scores[out.label];
    return `${out.label} (${(100 * p).toFixed(1)}%)${out.truncated ? " \u2014 cut to the token limit" : ""}`;
  }
  return out.tokens.map((t) => `${t.token}/${t.tag}`).join(" ");
}

async function runTry(ev) {
  ev.preventDefault();
  const option = $("try-tenant").selectedOptions[0];
  if (!option) return;
  const text = $("try-input").value;
  try {
    if (option.dataset.model === "decoder") {
      const out = await api("POST", `/v1/tenants/${option.value}/generate`, { prompt: text, max_new_tokens: 48 });
      $("try-output").replaceChildren(resultTable([[text, text + out.text]]));
    } else {
      const inputs = text.split("\n").map((s) => s.trim()).filter(Boolean);
      const body = { inputs };
      if ($("try-truncate").checked) body.truncate = true;
      const { outputs } = await api("POST", `/v1/tenants/${option.value}/infer`, body);
      $("try-output").replaceChildren(resultTable(inputs.map((x, i) => [x, describe(outputs[i])])));
    }
    showError(null);
  } catch (err) {
    showError(err);
  }
}

$("login").addEventListener("submit", connect);
$("try").addEventListener("submit", runTry);
for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => show(b.dataset.view));
