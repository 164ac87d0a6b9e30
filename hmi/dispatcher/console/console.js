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

const loaders = { tenants: loadTenants, domains: loadDomains, jobs: loadJobs, try: loadTenants };

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
