// streamscope's scope: the live view of the batch, the cache and every stream's fate.
//
// GET /scope/token says where the feed is (with an API key, its URL carries a read token
// of the feed: EventSource cannot send the key) and whose rows this page sees; then an
// EventSource reads /scope/events (app/routes/scope.py). Its events (app/wire/
// scope_events.py): "snapshot" (all there is to know now: first, and after the page was
// too slow and missed frames), "frame" (what changed at a step boundary), "error" (the
// server dropped this page, or stops). EventSource reconnects by itself with
// Last-Event-ID; the server replays what was missed or sends a snapshot. After an error
// event, or a refusal, the page asks for a token again and starts over after RETRY_MS.
//
// What it draws: a row per stream (its state, tokens, queue against its limit, whether
// its blocks are back), the steps on a canvas (ms each, decode rows and prefill), the
// block pool as a grid of cells, and the moments (a disconnect from close to release,
// a pause, a drop, a preemption). window.scope holds the state (tests read it).
"use strict";

const RETRY_MS = 1000;
const MAX_ENDED_ROWS = 64; // ended rows kept on the page
const MAX_STEPS = 240; // steps on the timeline
const MAX_MOMENTS = 50;
const MAX_CELLS = 640; // the pool's grid: past this, a cell stands for several blocks

const $ = (id) => document.getElementById(id);
const scope = (window.scope = {
  rows: new Map(), // short id -> row data
  steps: [],
  pool: null,
  moments: [],
  frames: 0,
  snapshots: 0,
  missed: 0,
  source: null,
});

function setStatus(text) {
  $("status").textContent = text;
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function start() {
  if (scope.source) scope.source.close();
  scope.source = null;
  setStatus("connecting");
  let answer;
  try {
    answer = await fetch("/scope/token", { headers: authHeaders() });
  } catch (error) {
    setStatus(`offline: ${error}`);
    setTimeout(start, RETRY_MS);
    return;
  }
  if (answer.status === 401) {
    $("auth").hidden = false;
    setStatus("needs an API key");
    return;
  }
  if (!answer.ok) {
    setStatus(`refused: ${answer.status}`);
    setTimeout(start, RETRY_MS);
    return;
  }
  const where = await answer.json();
  $("viewer").textContent = where.sees_all ? "every stream" : `key ${where.key}'s streams`;
  listen(where.events_url);
}

function listen(url) {
  const source = new EventSource(url);
  scope.source = source;
  source.onopen = () => setStatus("live");
  source.addEventListener("snapshot", (e) => apply(JSON.parse(e.data), true));
  source.addEventListener("frame", (e) => apply(JSON.parse(e.data), false));
  source.addEventListener("error", (e) => {
    if (e.data !== undefined) {
      // the server's own error event: this page was dropped (or the server stops)
      const error = JSON.parse(e.data).error;
      setStatus(`dropped: ${error.type}`);
      addMoment({ kind: error.type, id: null, detail: error.message });
      source.close();
      setTimeout(start, RETRY_MS);
    } else if (source.readyState === EventSource.CLOSED) {
      setStatus("refused; trying again");
      setTimeout(start, RETRY_MS);
    } else {
      setStatus("reconnecting");
    }
  });
}

function apply(frame, snapshot) {
  if (snapshot) {
    scope.snapshots += 1;
    scope.missed = frame.missed;
    const open = new Set(frame.rows.map((r) => r.id));
    for (const [id, row] of scope.rows) {
      if (!isOver(row) && !open.has(id)) scope.rows.delete(id); // gone while away
    }
    scope.steps = [];
    scope.moments = [];
    $("moments").textContent = "";
  }
  scope.frames += 1;
  for (const row of frame.rows) scope.rows.set(row.id, row);
  trimEnded();
  for (const step of frame.steps) scope.steps.push(step);
  scope.steps.splice(0, Math.max(0, scope.steps.length - MAX_STEPS));
  if (frame.pool) scope.pool = frame.pool;
  for (const moment of frame.moments) addMoment(moment);
  render();
}

function isOver(row) {
  return !["waiting", "prefilling", "running", "paused", "detached"].includes(row.state);
}

function trimEnded() {
  const ended = [...scope.rows.values()].filter(isOver);
  for (const row of ended.slice(0, Math.max(0, ended.length - MAX_ENDED_ROWS))) {
    scope.rows.delete(row.id);
  }
}

function render() {
  renderRows();
  drawSteps();
  drawPool();
  const last = scope.steps[scope.steps.length - 1];
  $("step").textContent = last ? `${last[0]} (${fmt(last[1])} ms)` : "–";
  $("missed").textContent = String(scope.missed);
  $("open").textContent = String([...scope.rows.values()].filter((r) => !isOver(r)).length);
}

function renderRows() {
  const body = $("rows");
  const seen = new Set();
  for (const row of scope.rows.values()) {
    seen.add(`row-${row.id}`);
    let tr = $(`row-${row.id}`);
    if (!tr) {
      tr = document.createElement("tr");
      tr.id = `row-${row.id}`;
      for (const name of ["id", "key", "band", "state", "tokens", "queue", "blocks", "text"]) {
        const td = document.createElement("td");
        td.className = name;
        tr.append(td);
      }
      tr.cells[0].textContent = row.id;
      body.prepend(tr);
    }
    tr.dataset.state = row.state;
    tr.dataset.released = String(row.released);
    tr.className = isOver(row) ? "over" : "";
    tr.cells[1].textContent = row.key ?? "–";
    tr.cells[2].textContent = String(row.band ?? 0);
    tr.cells[3].innerHTML = "";
    const badge = document.createElement("span");
    badge.className = `state s-${row.state}`;
    badge.textContent = row.state;
    tr.cells[3].append(badge);
    tr.cells[4].textContent = String(row.tokens);
    const share = isOver(row) ? 0 : Math.min(1, row.queued / row.limit);
    tr.cells[5].innerHTML = `<span class="queue" title="${row.queued}/${row.limit}">` +
      `<i style="width:${(share * 100).toFixed(0)}%"${share >= 1 ? ' class="full"' : ""}></i></span>`;
    tr.cells[6].textContent = !isOver(row) ? "held" : row.released ? "back" : "held";
    tr.cells[7].textContent = row.text ?? "";
  }
  for (const tr of [...body.rows]) if (!seen.has(tr.id)) tr.remove();
}

function drawSteps() {
  const canvas = $("timeline");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const steps = scope.steps;
  if (!steps.length) return;
  const target = steps[steps.length - 1][4];
  // The scale: most steps, not the rare long prefill (a taller bar is cut at the top).
  const sorted = steps.map((s) => s[1] ?? 0).sort((a, b) => a - b);
  const usual = sorted[Math.floor(sorted.length * 0.95)] || sorted[sorted.length - 1];
  const top = Math.max(target ?? 0, usual) * 1.15 || 1;
  const w = width / MAX_STEPS;
  steps.forEach(([, ms, decoded, prefilled], i) => {
    const h = Math.min(1, (ms ?? 0) / top) * (height - 14);
    const x = i * w;
    const share = decoded + prefilled ? prefilled / (decoded + prefilled) : 0;
    ctx.fillStyle = "#2a7d2a"; // decode, below
    ctx.fillRect(x, height - h * (1 - share), Math.max(1, w - 1), h * (1 - share));
    ctx.fillStyle = "#c98500"; // prefill, above
    ctx.fillRect(x, height - h, Math.max(1, w - 1), h * share);
  });
  if (target) {
    const y = height - (target / top) * (height - 14);
    ctx.strokeStyle = "#b22";
    ctx.beginPath();
    ctx.moveTo(0, y);
    ctx.lineTo(width, y);
    ctx.stroke();
  }
  ctx.fillStyle = "#555";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(`${fmt(top / 1.15)} ms`, 4, 11);
}

function drawPool() {
  const pool = scope.pool;
  const grid = $("pool");
  if (!pool) return;
  const per = Math.ceil(pool.total / MAX_CELLS); // blocks a cell stands for
  const cells = Math.ceil(pool.total / per);
  while (grid.children.length < cells) grid.append(document.createElement("i"));
  while (grid.children.length > cells) grid.lastChild.remove();
  [...grid.children].forEach((cell, i) => {
    const first = i * per; // a cell is drawn as its first block
    cell.className = first < pool.shared ? "shared" : first < pool.in_use ? "used" : "";
  });
  $("pool-counts").textContent = `${pool.in_use} in use (${pool.shared} shared), ` +
    `${pool.free} free of ${pool.total}, ${pool.cached} cached prefix blocks` +
    (per > 1 ? `; a cell is ${per} blocks` : "");
}

function addMoment(moment) {
  scope.moments.push(moment);
  const item = document.createElement("li");
  item.className = `moment-${moment.kind}`;
  const kind = document.createElement("b");
  kind.textContent = moment.kind;
  item.append(kind, ` ${moment.id ?? ""} ${describe(moment)}`);
  $("moments").prepend(item);
  while ($("moments").children.length > MAX_MOMENTS) $("moments").lastChild.remove();
}

function describe(m) {
  if (m.kind === "disconnect") {
    return `close → blocks back: ${m.steps} step${m.steps === 1 ? "" : "s"}, ` +
      `${fmt(m.ms)} ms. ${m.detail}`;
  }
  return m.count != null ? `${m.count}: ${m.detail}` : m.detail;
}

function fmt(ms) {
  return ms == null ? "–" : ms < 10 ? ms.toFixed(2) : ms.toFixed(1);
}

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  $("auth").hidden = true;
  start();
});
start();
