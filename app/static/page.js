// streamscope's page: one request at a time, read through EventSource, resumable.
//
// Start POSTs the form to /v1/requests (201 {id, stream_url}) and opens an EventSource
// on stream_url (GET /v1/stream/<id>, app/routes/resumable.py). Every event's id is
// "<id>:<n>". When the connection drops, EventSource reconnects by itself after the
// server's `retry` (1 s) and sends Last-Event-ID: the server replays what was missed,
// then follows live, taking the stream over from the old connection even if the server
// has not noticed yet that it died. A refusal (a 409 if the old connection's hand-over
// took too long, a 503 while another replica's store is away) or a 204 ends an
// EventSource for good, so the page opens a new one after REOPEN_MS with
// ?last_event_id=, a few times at most. The final event (done or error) closes the
// EventSource: left open, it would reconnect forever. An error event taken_over means
// another reader (another tab) took the stream: the page stops, not to take it back.
// Stop closes it and sends DELETE.
//
// API key: fetch sends it as Authorization: Bearer. EventSource cannot send headers:
// with a key set, the stream_url that POST /v1/requests answers carries a read token of
// that one stream (?token=<expiry>.<mac>, app/auth.py), so the key itself is never in a
// URL or cookie. The token is signed with a key derived from the API key and expires
// (STREAMSCOPE_STREAM_TOKEN_TTL_S): a reopen after that is refused (401) like any other.
"use strict";

const REOPEN_MS = 1000; // as the server's retry
const MAX_REOPENS = 5; // reopens with no event in between before the page gives up

const $ = (id) => document.getElementById(id);
let run = null; // the request in progress, or null
let lastRun = null; // the latest request, over or not (tests look at it)

function setStatus(text) {
  $("status").textContent = text;
}

function log(text) {
  const item = document.createElement("li");
  item.textContent = text;
  $("log").append(item);
}

function requestBody() {
  const body = {
    prompt: $("prompt").value,
    max_new_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("ignore-eos").checked) body.ignore_eos = true;
  return JSON.stringify(body);
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorText(response) {
  try {
    const error = (await response.json()).error;
    return `${response.status} ${error.type}: ${error.message}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function showMetrics(r) {
  $("tokens").textContent = String(r.tokens);
  if (r.tFirst === null) return;
  $("ttft").textContent = `${Math.round(r.tFirst - r.t0)} ms`;
  const seconds = (performance.now() - r.tFirst) / 1000;
  if (r.tokens > 1 && seconds > 0) $("tps").textContent = ((r.tokens - 1) / seconds).toFixed(1);
}

function finish(r, text) {
  r.over = true;
  if (r.source) r.source.close();
  if (run === r) run = null;
  $("start").disabled = false;
  $("stop").disabled = true;
  setStatus(text);
}

// Every event: remember its id (EventSource does too, for its own reconnects); after a
// reconnect, say where the stream resumed.
function received(r, event) {
  r.lastId = event.lastEventId;
  const n = Number(r.lastId.slice(r.lastId.lastIndexOf(":") + 1));
  r.reopens = 0;
  if (r.resuming) {
    r.resuming = false;
    r.resumes += 1;
    log(`reconnected, resumed at event ${n}`);
    setStatus(`streaming (reconnected, resumed at event ${n})`);
  }
  return n;
}

function connect(r) {
  const sep = r.url.includes("?") ? "&" : "?"; // stream_url may carry ?token=
  const query = r.lastId ? `${sep}last_event_id=${encodeURIComponent(r.lastId)}` : "";
  const source = new EventSource(r.url + query);
  r.source = source;
  source.addEventListener("open", () => {
    r.opens += 1;
    if (r.opens > 1) r.resuming = true;
  });
  source.addEventListener("start", (event) => {
    received(r, event);
    if (r.resumes === 0) setStatus("streaming");
  });
  source.addEventListener("token", (event) => {
    received(r, event);
    const token = JSON.parse(event.data);
    $("output").append(token.text);
    r.tokens += 1;
    if (r.tFirst === null) r.tFirst = performance.now();
    showMetrics(r);
  });
  source.addEventListener("done", (event) => {
    received(r, event);
    const done = JSON.parse(event.data);
    showMetrics(r);
    const resumed = r.resumes ? `, resumed ${r.resumes}×` : "";
    finish(r, `done: ${done.finish_reason}, ${done.usage.completion_tokens} tokens${resumed}`);
  });
  // "error" is both the server's event (a MessageEvent with data) and EventSource's
  // own report of a lost or refused connection (a plain Event).
  source.addEventListener("error", (event) => {
    if (r.over || r.source !== source) return;
    if (event instanceof MessageEvent) {
      received(r, event);
      const error = JSON.parse(event.data).error;
      finish(r, error.type === "taken_over"
        ? "stopped: another reader (another tab?) took this stream over"
        : `error: ${error.type}: ${error.message}`);
    } else if (source.readyState === EventSource.CONNECTING) {
      log(`connection lost after event ${r.lastId ? r.lastId.split(":").pop() : 0}; reconnecting`);
      setStatus("connection lost, reconnecting…");
    } else if (r.reopens >= MAX_REOPENS) {
      finish(r, "lost: the stream is over or expired on the server");
    } else {
      r.reopens += 1;
      log(`reconnect refused; opening the stream again in ${REOPEN_MS / 1000} s`);
      setStatus("reconnecting…");
      setTimeout(() => { if (!r.over) connect(r); }, REOPEN_MS);
    }
  });
}

async function start(event) {
  event.preventDefault();
  if (run) return;
  const r = {
    id: null, url: null, source: null, lastId: null, over: false,
    t0: performance.now(), tFirst: null, tokens: 0,
    opens: 0, resuming: false, resumes: 0, reopens: 0,
  };
  run = r;
  lastRun = r;
  $("output").textContent = "";
  $("log").textContent = "";
  for (const id of ["ttft", "tps"]) $(id).textContent = "–";
  showMetrics(r);
  $("start").disabled = true;
  $("stop").disabled = false;
  setStatus("sending…");
  let response;
  try {
    response = await fetch("/v1/requests", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: requestBody(),
    });
  } catch (err) {
    finish(r, `failed: ${err}`);
    return;
  }
  if (response.status !== 201) {
    finish(r, `refused: ${await errorText(response)}`);
    return;
  }
  const created = await response.json();
  r.id = created.id;
  r.url = created.stream_url;
  if (r.over) {
    cancel(r); // Stop came while the POST was on its way
    return;
  }
  setStatus("waiting for the first event…");
  connect(r);
}

async function cancel(r) {
  let text;
  try {
    const response = await fetch(`/v1/requests/${r.id}`, { method: "DELETE", headers: authHeaders() });
    text = response.status === 204 ? "stopped"
      : response.status === 404 ? "stopped (it had already ended)"
        : `stop failed: ${await errorText(response)}`;
  } catch (err) {
    text = `stop failed: ${err}`;
  }
  if (run === null) setStatus(text);
}

function stop() {
  const r = run;
  if (!r) return;
  finish(r, "stopping…");
  if (r.id !== null) cancel(r);
}

$("form").addEventListener("submit", start);
$("stop").addEventListener("click", stop);
