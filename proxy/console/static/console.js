// The operator console: a live table of tasks fed by the event stream, a detail view, cancel.
// No build step, no dependencies. Talks only to /console/api/ (see proxy/console/api.py).
"use strict";

const $ = (selector) => document.querySelector(selector);
const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const COLORS = { working: "#1565c0", input_required: "#ef6c00", completed: "#2e7d32", failed: "#c62828", cancelled: "#9aa0ad" };
const state = { runningLoop: false, signIn: 0, csrf: null, rows: new Map(), filters: {}, cursor: null, selected: null, source: null, timers: [], renderQueued: false, overviewQueued: false };

async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  if (options.method === "POST") headers["X-CSRF-Token"] = state.csrf || "";
  const signIn = state.signIn;  // a 401 asked for before a later sign-in says nothing of that one
  const resp = await fetch(path, { credentials: "same-origin", ...options, headers });
  const body = await resp.json().catch(() => ({}));
  if (resp.status === 401 && signIn === state.signIn) showLogin();
  if (!resp.ok) throw new Error((body.error && body.error.message) || resp.statusText);
  return body;
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function fmtAge(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

const fmtTime = (ms) => (Number.isFinite(ms) && ms > 0 && ms <= 8.64e15 ? new Date(ms).toISOString().replace("T", " ").replace("Z", " UTC") : "—");

// -- signing in and out -----------------------------------------------------------------------

function showLogin() {
  if (state.source) state.source.close();
  state.source = null;
  state.timers.forEach(clearInterval);
  state.timers = [];
  $("#app").hidden = true;
  $("#who").hidden = true;
  $("#login").hidden = false;
}

async function start() {
  let session;
  try {
    session = await api("/console/api/session");
  } catch (e) {
    showLogin();
    return;
  }
  state.signIn += 1;
  state.csrf = session.csrf;
  $("#operator").textContent = session.operator;
  const servers = $("#filter-server");
  servers.replaceChildren(el("option", "any server"));
  servers.firstChild.value = "";
  session.servers.forEach((name) => servers.append(el("option", name)));
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#who").hidden = false;
  openStream();
  loadOverview();
  state.timers.forEach(clearInterval);
  state.timers = [];
  state.timers.push(setInterval(loadOverview, 10000), setInterval(refreshAges, 1000));
  if (!state.runningLoop) loadRunning();
}

$("#login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("#login-error").textContent = "";
  const resp = await fetch("/console/login", { method: "POST", body: new URLSearchParams({ token: $("#token").value }), credentials: "same-origin" });
  if (resp.ok) {
    $("#token").value = "";
    start();
  } else {
    const body = await resp.json().catch(() => ({}));
    $("#login-error").textContent = (body.error && body.error.message) || "sign-in failed";
  }
});

$("#signout").addEventListener("click", async () => {
  await api("/console/logout", { method: "POST" }).catch(() => {});
  showLogin();
});

// -- the live table -----------------------------------------------------------------------------

function setLive(on) {
  const pill = $("#live");
  pill.textContent = on ? "live" : "reconnecting";
  pill.className = on ? "pill on" : "pill off";
}

function openStream() {
  if (state.source) state.source.close();
  const source = new EventSource("/console/api/events");
  source.addEventListener("ready", () => { setLive(true); reload(); });
  source.addEventListener("resync", () => reload());
  source.addEventListener("task", (event) => onTask(JSON.parse(event.data)));
  source.onerror = () => {
    setLive(false);
    if (source.readyState === EventSource.CLOSED) setTimeout(start, 3000);  // refused: signed out, or restarted
  };
  state.source = source;
}

function matches(row) {
  const f = state.filters;
  return (!f.status || row.status === f.status) && (!f.server || row.server === f.server) &&
    (!f.tool || row.tool === f.tool) && (!f.principal || row.principalHash === f.principal.toLowerCase());
}

function oldestLoaded() {
  let oldest = Infinity;
  state.rows.forEach((row) => { oldest = Math.min(oldest, row.createdMs); });
  return oldest;
}

function onTask(row) {
  const known = state.rows.get(row.taskId);
  if (known && known.version > row.version) return;
  if (!matches(row)) state.rows.delete(row.taskId);
  else if (known || state.cursor === null || row.createdMs >= oldestLoaded()) state.rows.set(row.taskId, row);
  queueRender();
  if (state.selected === row.taskId) showDetail(row.taskId);
  if (row.status !== (row.previousStatus || "")) queueOverview();
}

function queueOverview() {  // status changes move the charts: refresh them, at most once a second
  if (state.overviewQueued) return;
  state.overviewQueued = true;
  setTimeout(() => { state.overviewQueued = false; loadOverview(); }, 1000);
}

async function reload() {
  state.rows.clear();
  state.cursor = null;
  await loadPage();
}

async function loadPage() {
  const params = new URLSearchParams({ limit: "50" });
  Object.entries(state.filters).forEach(([key, value]) => { if (value) params.set(key, value); });
  if (state.cursor) params.set("cursor", state.cursor);
  try {
    const page = await api(`/console/api/tasks?${params}`);
    page.tasks.forEach((row) => { if (!state.rows.has(row.taskId)) state.rows.set(row.taskId, row); });
    state.cursor = page.nextCursor;
    $("#app-error").textContent = page.tasks.length || !state.cursor ? "" : "no matches on this page yet: load more";
  } catch (e) {
    $("#app-error").textContent = e.message;
  }
  $("#more").hidden = !state.cursor;
  queueRender();
}

function queueRender() {
  if (state.renderQueued) return;
  state.renderQueued = true;
  requestAnimationFrame(() => { state.renderQueued = false; render(); });
}

function render() {
  const rows = [...state.rows.values()].sort((a, b) => b.createdMs - a.createdMs || (a.taskId < b.taskId ? -1 : 1));
  const now = Date.now();
  $("#tasks tbody").replaceChildren(...rows.map((row) => {
    const tr = el("tr");
    tr.dataset.taskId = row.taskId;
    if (row.taskId === state.selected) tr.className = "selected";
    const status = el("td", row.status, `status s-${row.status}`);
    const age = el("td", fmtAge(now - row.createdMs), "age");
    age.dataset.ms = row.createdMs;
    const updated = el("td", `${fmtAge(now - row.lastUpdatedMs)} ago`, "age");
    updated.dataset.ms = row.lastUpdatedMs;
    updated.dataset.suffix = " ago";
    tr.append(status, el("td", row.server), el("td", row.tool), el("td", row.principalHash, "principal"), age, updated, el("td", row.statusMessage || "", "msg"));
    tr.addEventListener("click", () => showDetail(row.taskId));
    return tr;
  }));
}

function refreshAges() {
  const now = Date.now();
  document.querySelectorAll("td.age").forEach((td) => { td.textContent = fmtAge(now - Number(td.dataset.ms)) + (td.dataset.suffix || ""); });
}

$("#filters").addEventListener("submit", (event) => {
  event.preventDefault();
  state.filters = Object.fromEntries([...new FormData(event.target).entries()].filter(([, v]) => v));
  reload();
});
$("#filters").addEventListener("reset", () => setTimeout(() => { state.filters = {}; reload(); }));
$("#more").addEventListener("click", loadPage);

// -- the detail view and cancel -----------------------------------------------------------------

async function showDetail(taskId) {
  state.selected = taskId;
  queueRender();
  let task;
  try {
    task = await api(`/console/api/tasks/${encodeURIComponent(taskId)}`);
  } catch (e) {
    $("#d-id").textContent = `${taskId}: ${e.message}`;
    $("#d-fields").replaceChildren();
    $("#cancel-btn").hidden = true;
    return;
  }
  if (state.selected !== taskId) return;
  fillDetail(task);
}

function fillDetail(task) {
  $("#detail").hidden = false;
  $("#detail").dataset.taskId = task.taskId;
  $("#d-id").textContent = task.taskId;
  const fields = [
    ["status", task.status], ["server", task.server], ["tool", task.tool], ["principal", task.principalHash],
    ["method", task.method], ["owner", `${task.owner}${task.runningHere ? " (this process)" : task.ownerAlive ? "" : " (gone)"}`],
    ["created", fmtTime(task.createdMs)], ["last update", fmtTime(task.lastUpdatedMs)],
    ["message", task.statusMessage || "—"], ["expires", task.expiresMs ? fmtTime(task.expiresMs) : "not while it runs"],
    ["requests", task.requests > 1 ? `${task.requests} (retries joined it)` : "1"],
    ["trace", task.traceId || "— (tracing off)"],
  ];
  $("#d-fields").replaceChildren(...fields.flatMap(([name, value]) => {
    const dd = el("dd", value, name === "status" ? `status s-${value}` : "");
    dd.dataset.field = name;
    return [el("dt", name), dd];
  }));
  $("#d-history").replaceChildren(...task.history.map((entry) => el("li", `${entry.status} at ${fmtTime(entry.atMs)} (+${((entry.atMs - task.createdMs) / 1000).toFixed(1)} s)`)));
  const inputs = Object.keys(task.inputRequests || {});
  $("#d-inputs-box").hidden = inputs.length === 0;
  $("#d-inputs").textContent = JSON.stringify(task.inputRequests, null, 2);
  $("#d-outcome-box").hidden = !task.outcome;
  if (task.outcome) {
    $("#d-outcome-title").textContent = `${task.outcome.kind === "result" ? "Result" : "Error"} (${task.outcome.sizeBytes} bytes)`;
    $("#d-outcome").textContent = task.outcome.preview + (task.outcome.truncated ? "\n… (cut; the client reads it whole)" : "");
  }
  $("#cancel-btn").hidden = TERMINAL.has(task.status);
}

$("#close-detail").addEventListener("click", () => { state.selected = null; $("#detail").hidden = true; queueRender(); });

$("#cancel-btn").addEventListener("click", () => {
  $("#confirm-id").textContent = state.selected;
  $("#confirm").returnValue = "";
  $("#confirm").showModal();
});

$("#confirm").addEventListener("close", async () => {
  if ($("#confirm").returnValue !== "yes" || !state.selected) return;
  try {
    fillDetail(await api(`/console/api/tasks/${encodeURIComponent(state.selected)}/cancel`, { method: "POST" }));
  } catch (e) {
    $("#d-fields").prepend(el("dd", `cancel refused: ${e.message}`, "error"));
  }
});

// -- overview: readiness and charts from the proxy's own metrics --------------------------------

function svgNode(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  Object.entries(attrs).forEach(([key, value]) => node.setAttribute(key, value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function barChart(svg, bars, labelEvery = 1) {
  const width = Number(svg.getAttribute("width")), height = Number(svg.getAttribute("height")) - 28;
  const max = Math.max(1, ...bars.map((b) => b.value));
  const step = width / Math.max(1, bars.length);
  svg.replaceChildren(...bars.flatMap((bar, i) => {
    const h = Math.round((bar.value / max) * (height - 12));
    const x = i * step + 2, w = Math.max(2, step - 4);
    const nodes = [svgNode("rect", { x, y: height - h + 12, width: w, height: h, fill: bar.color || "#2f5bd3" }),
      svgNode("text", { x: x + w / 2, y: height - h + 9, "text-anchor": "middle" }, bar.value ? String(Math.round(bar.value)) : "")];
    if (i % labelEvery === 0) nodes.push(svgNode("text", { x: x + w / 2, y: height + 24, "text-anchor": "middle" }, bar.label));
    return nodes;
  }));
}

async function loadOverview() {
  let data;
  try {
    data = await api("/console/api/overview");
  } catch (e) {
    return;
  }
  const items = Object.entries(data.upstreams).map(([name, check]) => el("li", check === "ok" ? `${name}: ready` : `${name}: ${check}`, check === "ok" ? "" : "bad"));
  items.push(el("li", data.store === "ok" ? "task store: writable" : `task store: ${data.store}`, data.store === "ok" ? "" : "bad"));
  items.push(el("li", `${data.liveHere} detached call(s) running in this process`));
  $("#upstreams").replaceChildren(...items);
  barChart($("#chart-status"), Object.keys(COLORS).map((status) => ({ label: status.replace("input_required", "input"), value: data.tasksByStatus[status] || 0, color: COLORS[status] })));
  const buckets = data.detachDelay.buckets.map((b) => ({ label: b.le === "+Inf" ? "more" : b.le, value: b.count }));
  barChart($("#chart-detach"), buckets, 3);
}

// -- running now: every replica's requests in flight, synchronous calls included ----------------

async function loadRunning() {  // polled: the next poll is asked for 2 s after this one answered
  state.runningLoop = true;
  try {
    showRunning(await api("/console/api/running?limit=100"));
  } catch (e) {
    $("#running tbody").replaceChildren();  // rows that may have ended are not left standing
    $("#running-summary").textContent = e.message;
  }
  if ($("#app").hidden) state.runningLoop = false;  // signed out: start() polls again
  else setTimeout(loadRunning, 2000);
}

function showRunning(data) {
  const rows = data.requests.map((r) => {
    const tr = el("tr");
    const replica = r.relayedBy ? `${r.replica} (via ${r.relayedBy})` : r.replica;
    // the id its client holds: a relayed request's is the first replica's (also when that row is not listed)
    const clientId = r.relayedRequestId || r.requestId;
    [fmtAge(r.ageMs), replica, r.server, r.era, r.rpcMethod || r.httpMethod, r.tool, r.principalHash, clientId, r.upstreamRequestId, r.taskId]
      .forEach((value, i) => tr.append(el("td", value === undefined ? "—" : value, i >= 6 ? "principal" : "")));
    tr.title = `started ${fmtTime(r.startedMs)}` + (r.relayedRequestId ? `, request ${r.requestId} on ${r.replica}` : "") + (r.traceId ? `, trace ${r.traceId}` : "");
    return tr;
  });
  if (!rows.length) {
    const empty = el("td", "nothing in flight", "msg");
    empty.colSpan = 10;
    rows.push(el("tr"));
    rows[0].append(empty);
  }
  $("#running tbody").replaceChildren(...rows);
  const listed = data.replicas.filter((r) => !r.error).length;
  const gone = data.replicas.filter((r) => r.error).map((r) => r.error);
  const shown = data.requests.length < data.total ? `, the ${data.requests.length} longest-running shown` : "";
  $("#running-summary").textContent = `${data.total} request(s) on ${listed} replica(s)${shown}` + (gone.length ? `; not listed: ${gone.join("; ")}` : "");
}

start();
