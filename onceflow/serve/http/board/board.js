// The onceflow board: tasks by workflow step (live over Server-Sent Events), a task's history, the runs
// queue with pauses, host calls, and each workflow's graph. Plain script, nothing fetched but this server.
"use strict";

const PAGE = 500;          // tasks per list_tasks page
const MAX_CARDS = 100;     // cards shown per column; the rest are counted ("+N more")
const RETRY_MS = 2000;
const MAX_PENDING = 1000;  // events held while the board loads; past it they are dropped, it loads again

const state = {
  token: sessionStorage.getItem("onceflow.token") || "",
  role: "read",
  lanes: new Map(),        // workflow_id -> {el, columns: Map(step_id -> column)}
  cards: new Map(),        // task_id -> card element (shown cards only)
  steps: new Map(),        // task_id -> "workflow/step" for shown cards
  lastEventId: null,
  loaded: false,
  pending: [],             // events received before the load finished (at most MAX_PENDING)
  stale: false,            // events were dropped during the load: load again
  total: 0,
};

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function headers(extra) {
  const out = Object.assign({}, extra || {});
  if (state.token) out.Authorization = "Bearer " + state.token;
  return out;
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({}, options || {}, { headers: headers((options || {}).headers) }));
  if (response.status === 401) {
    $("login").hidden = false;
    throw new Error("unauthorized");
  }
  const reply = await response.json();
  return reply;
}

async function send(command) {
  const reply = await api("/v1/commands", {
    method: "POST",
    body: JSON.stringify(command),
    headers: { "Content-Type": "application/json" },
  });
  if (!reply.ok) alert(command.type + ": " + reply.error.message);
  refreshSoon();
  return reply;
}

// --- lanes, columns, cards ---------------------------------------------------------------------------

function lane(workflowId) {
  let found = state.lanes.get(workflowId);
  if (!found) {
    const columns = el("div", { class: "columns" });
    const node = el("section", { class: "lane", "data-workflow": workflowId }, el("h2", {}, workflowId), columns);
    $("lanes").append(node);
    found = { el: node, columnsEl: columns, columns: new Map() };
    state.lanes.set(workflowId, found);
  }
  return found;
}

function column(workflowId, stepId, name) {
  const owner = lane(workflowId);
  let found = owner.columns.get(stepId);
  if (!found) {
    const count = el("span", { class: "n" }, "0");
    const more = el("div", { class: "more" });
    const cards = el("div", { class: "cards" });
    const node = el("div", { class: "column", "data-step": stepId },
      el("h3", {}, el("span", {}, name || stepId), count), cards, more);
    owner.columnsEl.append(node);
    found = { el: node, cards, countEl: count, moreEl: more, count: 0 };
    owner.columns.set(stepId, found);
  }
  return found;
}

function recount(col) {
  col.countEl.textContent = String(col.count);
  const hidden = col.count - col.cards.childElementCount;
  col.moreEl.textContent = hidden > 0 ? "+" + hidden + " more" : "";
}

function card(task) {
  return el("div", {
    class: "card" + (task.wip_admitted === false ? " queued" : ""),
    "data-task-id": task.task_id,
    "data-priority": task.priority || "medium",
    onclick: () => openHistory(task.task_id, task.title),
  }, el("div", { class: "title" }, task.title || task.task_id), el("div", { class: "id" }, task.task_id));
}

function place(task, counted) {
  const col = column(task.workflow_id, task.step_id);
  if (counted) col.count += 1;
  if (!state.cards.has(task.task_id) && col.cards.childElementCount < MAX_CARDS) {
    const node = card(task);
    col.cards.append(node);
    state.cards.set(task.task_id, node);
    state.steps.set(task.task_id, task.workflow_id + "/" + task.step_id);
  }
  recount(col);
}

function moveCard(taskId, workflowId, fromStep, toStep) {
  const key = workflowId + "/" + toStep;
  const shown = state.cards.get(taskId);
  if (shown && state.steps.get(taskId) === key) return;  // already there (an event older than the load)
  const source = lane(workflowId).columns.get(fromStep);
  if (source) { source.count = Math.max(0, source.count - 1); }
  const target = column(workflowId, toStep);
  target.count += 1;
  if (shown) {
    target.cards.prepend(shown);
    state.steps.set(taskId, key);
    if (target.cards.childElementCount > MAX_CARDS) {
      const last = target.cards.lastElementChild;
      state.cards.delete(last.dataset.taskId);
      state.steps.delete(last.dataset.taskId);
      last.remove();
    }
  } else if (target.cards.childElementCount < MAX_CARDS) {
    api("/v1/tasks/" + encodeURIComponent(taskId)).then((reply) => {
      if (reply.ok && !state.cards.has(taskId)) place(reply.result, false);
    });
  }
  if (source) recount(source);
  recount(target);
}

// --- loading -----------------------------------------------------------------------------------------

async function loadWorkflows() {
  const reply = await api("/v1/workflows").catch(() => null);
  const graphs = $("graphs");
  graphs.textContent = "";
  if (!reply || !reply.ok) {
    graphs.append(el("p", { class: "muted" }, "no workflow listing on this server"));
    return;
  }
  const workflows = reply.result.workflows || reply.result.items || [];
  for (const workflow of workflows) {
    const id = workflow.workflow_id || workflow.id;
    const detail = await api("/v1/workflows/" + encodeURIComponent(id));
    const steps = detail.ok ? stepsOf(detail.result) : [];
    for (const step of steps) column(id, step.id, step.name);
    const versions = workflow.versions || [workflow.version || workflow.current_version || null];
    for (const version of versions) {
      const query = version === null || version === undefined ? "" : "?version=" + encodeURIComponent(
        typeof version === "object" ? version.version : version);
      const image = el("img", { alt: "graph of " + id, "data-workflow": id });
      graphs.append(el("div", { class: "graph" }, el("h3", {}, id + (query ? " v" + query.slice(9) : "")), image));
      fetch("/v1/workflows/" + encodeURIComponent(id) + "/graph.svg" + query, { headers: headers() })
        .then((r) => (r.ok ? r.blob() : null))
        .then((blob) => { if (blob) image.src = URL.createObjectURL(blob); });
    }
  }
}

function stepsOf(result) {
  const holder = result.workflow || result.template || result.definition || result;
  const steps = (holder && holder.steps) || [];
  return steps.slice().sort((a, b) => (a.position || 0) - (b.position || 0));
}

async function loadTasks() {
  let after = null;
  let first = true;
  state.total = 0;
  do {
    const query = "?limit=" + PAGE + (after ? "&after=" + encodeURIComponent(after) : "");
    const reply = await api("/v1/tasks" + query);
    if (!reply.ok) break;
    for (const task of reply.result.tasks) place(task, true);
    state.total += reply.result.tasks.length;
    $("count").textContent = state.total + " tasks";
    after = reply.result.next_after_task_id;
    if (first) {
      first = false;
      document.body.dataset.painted = String(performance.now());  // the first page is on screen
    }
    await new Promise((resolve) => setTimeout(resolve, 0));  // let the page paint between pages
  } while (after);
}

function resetLanes() {
  $("lanes").textContent = "";
  state.lanes.clear();
  state.cards.clear();
  state.steps.clear();
}

async function reload() {
  state.loaded = false;
  do {
    if (state.stale) state.pending = [];  // the next load reads what the dropped events did
    state.stale = false;
    resetLanes();
    await loadWorkflows();
    await loadTasks();
  } while (state.stale);
  state.loaded = true;
  const pending = state.pending;
  state.pending = [];
  for (const item of pending) apply(item);
  document.body.dataset.loaded = "true";
  refreshSide();
}

// --- side panels -------------------------------------------------------------------------------------

let refreshTimer = null;
function refreshSoon() {
  if (refreshTimer === null) refreshTimer = setTimeout(() => { refreshTimer = null; refreshSide(); }, 300);
}

function refreshSide() {
  loadQueue().catch(() => {});
  loadHostCalls().catch(() => {});
}

function button(text, command) {
  if (state.role !== "write") return null;
  return el("button", { type: "button", onclick: () => send(command), "data-action": command.type }, text);
}

function pausedSet(reply) {
  const out = new Set();
  if (!reply || !reply.ok) return out;
  const rows = reply.result.pauses || reply.result.items || reply.result || [];
  for (const row of Array.isArray(rows) ? rows : []) {
    if (row.scope === "agent") out.add(row.id);
  }
  return out;
}

async function loadQueue() {
  const [stats, pauses, runs] = await Promise.all([
    api("/v1/queue").catch(() => null),
    api("/v1/pauses").catch(() => null),
    api("/v1/runs?limit=200&status=queued"),
  ]);
  const paused = pausedSet(pauses);
  const agents = new Map();
  if (stats && stats.ok) {
    const rows = stats.result.agents || stats.result.items || [];
    for (const row of rows) {
      const id = row.agent_profile_id || row.agent || row.id;
      agents.set(id, { row, runs: [] });
      if (row.paused) paused.add(id);
    }
  }
  for (const run of (runs.ok ? runs.result.runs : [])) {
    if (!agents.has(run.agent_profile_id)) agents.set(run.agent_profile_id, { row: null, runs: [] });
    agents.get(run.agent_profile_id).runs.push(run);
  }
  for (const id of paused) if (!agents.has(id)) agents.set(id, { row: null, runs: [] });
  const table = el("table", {}, el("tr", {}, el("th", {}, "agent"), el("th", {}, "queued"),
    el("th", {}, "ceiling"), el("th", {}, "")));
  for (const [id, entry] of agents) {
    const isPaused = paused.has(id);
    const row = entry.row || {};
    const ceiling = row.ceiling ?? row.max_concurrent ?? row.limit ?? "";
    const queued = row.queued ?? entry.runs.length;
    table.append(el("tr", { "data-agent": id, "data-paused": String(isPaused) },
      el("td", {}, id, isPaused ? el("span", { class: "paused" }, " paused") : null),
      el("td", {}, String(queued)), el("td", {}, String(ceiling)),
      el("td", {}, isPaused ? button("resume", { type: "resume", scope: "agent", id: id })
        : button("pause", { type: "pause", scope: "agent", id: id, reason: "paused from the board" }))));
    for (const run of entry.runs.slice(0, 5)) {
      table.append(el("tr", { class: "run", "data-run": String(run.id) },
        el("td", { class: "muted" }, "#" + run.id + " " + (run.task_id || "")), el("td", {}, run.status),
        el("td", {}, run.step_id || ""),
        el("td", {}, run.status === "failed" || run.status === "cancelled"
          ? button("retry", { type: "retry_run", run_id: run.id })
          : button("cancel", { type: "cancel_run", run_id: run.id, reason: "cancelled_from_board" }))));
    }
  }
  const holder = $("queue");
  holder.textContent = "";
  holder.append(agents.size ? table : el("p", { class: "muted" }, "no runs queued"));
}

async function loadHostCalls() {
  const replies = await Promise.all(["pending", "unavailable"].map(
    (status) => api("/v1/host-calls?limit=50&status=" + status)));
  const holder = $("hostcalls");
  holder.textContent = "";
  const calls = replies.flatMap((reply) => (reply.ok ? reply.result.calls : []));
  if (!calls.length) { holder.append(el("p", { class: "muted" }, "none waiting or unavailable")); return; }
  const table = el("table", {});
  for (const call of calls) {
    table.append(el("tr", {}, el("td", {}, call.kind), el("td", {}, call.task_id || ""),
      el("td", {}, call.status)));
  }
  holder.append(table);
}

async function openHistory(taskId, title) {
  $("drawer").hidden = false;
  $("drawer-title").textContent = title || taskId;
  const list = $("history");
  list.textContent = "";
  const reply = await api("/v1/tasks/" + encodeURIComponent(taskId) + "/history?limit=200");
  if (!reply.ok) { list.append(el("li", {}, reply.error.message)); return; }
  for (const item of reply.result.items) {
    const d = item.detail;
    const text = item.kind === "transition" ? d.from_step + " → " + d.to_step + " (" + d.trigger + ")"
      : item.kind === "run" ? "run #" + d.run_id + " " + d.status + " for " + d.agent_profile_id
      : item.kind === "decision" ? d.decision + " by " + d.decider_id
      : item.kind === "created" ? "created at " + d.step_id
      : (d.kind || "") + " " + (d.status || "");
    list.append(el("li", {}, el("span", { class: "kind" }, item.kind), " ", text,
      el("div", { class: "muted" }, item.at)));
  }
}

// --- events ------------------------------------------------------------------------------------------

function apply(item) {
  if (item.gap) { reload(); return; }
  const event = item.event;
  if (event.type === "task_created") {
    if (!state.cards.has(event.task_id)) {
      state.total += 1;
      $("count").textContent = state.total + " tasks";
      place({ task_id: event.task_id, workflow_id: event.workflow_id, step_id: event.step_id, title: "" }, true);
      api("/v1/tasks/" + encodeURIComponent(event.task_id)).then((reply) => {
        const node = state.cards.get(event.task_id);
        if (reply.ok && node) node.replaceWith(adopt(reply.result));
      });
    }
  } else if (event.type === "transition") {
    moveCard(event.task_id, event.workflow_id, event.from_step, event.to_step);
  } else if (event.type.startsWith("run_") || event.type.startsWith("host_call") ||
             event.type === "flow_changed") {
    refreshSoon();
  }
}

function adopt(task) {
  const node = card(task);
  state.cards.set(task.task_id, node);
  return node;
}

async function stream() {
  for (;;) {
    try {
      const extra = state.lastEventId === null ? {} : { "Last-Event-ID": state.lastEventId };
      const response = await fetch("/v1/events", { headers: headers(extra) });
      if (!response.ok) throw new Error("events: " + response.status);
      $("status").dataset.state = "live";
      $("status").textContent = "live";
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          handleBlock(block);
        }
      }
    } catch (error) {
      // reconnect below
    }
    $("status").dataset.state = "reconnecting";
    $("status").textContent = "reconnecting";
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

function handleBlock(block) {
  let id = null, kind = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("id: ")) id = line.slice(4);
    else if (line.startsWith("event: ")) kind = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return;
  const item = kind === "gap" ? { gap: JSON.parse(data) } : { event: JSON.parse(data) };
  if (id !== null) state.lastEventId = id;
  if (state.loaded) apply(item);
  else if (item.gap) return;
  else if (state.pending.length < MAX_PENDING) state.pending.push(item);
  else state.stale = true;
}

// --- start -------------------------------------------------------------------------------------------

async function start() {
  const fromFragment = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromFragment) {
    state.token = fromFragment;
    sessionStorage.setItem("onceflow.token", fromFragment);
    history.replaceState(null, "", location.pathname);
  }
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("onceflow.token", $("token").value);
    location.reload();
  });
  $("close").addEventListener("click", () => { $("drawer").hidden = true; });
  try {
    const session = await fetch("/v1/session", { headers: headers() });
    if (session.status === 401) { $("login").hidden = false; return; }
    state.role = (await session.json()).role;
    $("role").textContent = state.role === "write" ? "read/write" : "read-only";
  } catch (error) { return; }
  stream();
  await reload();
}

async function renderDocs() {
  const doc = await (await fetch("/openapi.json")).json();
  const holder = $("api");
  holder.textContent = "";
  holder.append(el("p", {}, doc.info.description));
  for (const [path, methods] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const body = op.requestBody ? op.requestBody.content["application/json"].schema.$ref : null;
      const schema = body ? doc.components.schemas[body.split("/").pop()] : null;
      const fields = schema && schema.properties ? Object.keys(schema.properties).join(", ") : "";
      holder.append(el("details", { "data-operation": op.operationId },
        el("summary", {}, el("code", {}, method.toUpperCase() + " " + path), " " + (op.summary || "")),
        el("p", {}, op.description || (schema && schema.description) || ""),
        fields ? el("p", { class: "muted" }, "fields: " + fields) : null));
    }
  }
}

if (document.body.dataset.page === "docs") renderDocs(); else start();
