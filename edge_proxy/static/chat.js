// The chat page: a conversation over EdgeChat (edgechat.js), streamed as it arrives and
// shown as markdown (markdown.js: DOM nodes only, never the model's HTML), with a stop
// button, per-message TTFT, tokens/s, region and replica, and reconnects.
//
// Connection trouble is said in words (#notice), and a server that wants an API key gets
// the key field focused and marked. A message sent while not connected waits in its
// bubble ("waiting for the connection: why") and goes out once the page connects (Connect
// with a key keeps the same client, so it is sent exactly once); Stop drops it. One reply
// at a time: Send is disabled and Stop enabled while one is waiting or streaming.
// window.edgechat exposes the client and every reply's figures and text (tests, bench/clients.py).
import {EdgeChat} from "./edgechat.js";
import {MarkdownView} from "./markdown.js";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("message"), sendBtn = $("send"), stopBtn = $("stop"), statusEl = $("status");
const keyInput = $("key"), notice = $("notice");
keyInput.value = localStorage.getItem("edgechat.key") ?? "";

const history = [];  // {role, content}: what the next turn sends
const replies = [];  // per assistant message: Request.stats() and its text, once it ended
const chat = new EdgeChat({key: keyInput.value.trim()});
let current = null;  // the request waiting or streaming now
let waitingNote = null;  // its bubble's "waiting for the connection" line, while it waits

const LABELS = {unauthorized: "needs a key", bad_key: "bad key", forbidden: "refused"};
const HINTS = {unauthorized: "Enter the API key above and press Connect.",
               bad_key: "Check the API key above and press Connect.",
               forbidden: "Open the page from the server itself."};

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  el.append(body);
  log.append(el);
  log.scrollTop = log.scrollHeight;
  return el;
}

function meta(el, s) {
  let m = el.querySelector(".meta");
  if (!m) { m = document.createElement("span"); m.className = "meta"; el.append(m); }
  const parts = [];
  if (s.ttft_ms != null) parts.push(`TTFT ${s.ttft_ms.toFixed(0)} ms`);
  if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  parts.push(`${s.tokens} tokens`);
  if (s.replica) parts.push(`${s.region} / ${s.replica}`);
  if (s.finish_reason) parts.push(s.finish_reason === "abort" ? "stopped" : s.finish_reason);
  if (s.resumes) parts.push(`resumed ${s.resumes}x`);
  m.textContent = parts.join(" · ");
  el.dataset.ttftMs = s.ttft_ms ?? "";
  el.dataset.tokensPerS = s.tokens_per_s ?? "";
  el.dataset.region = s.region;
  el.dataset.replica = s.replica;
}

function waitingText() {
  const f = chat.failure;
  return f ? `waiting for the connection: ${f.message}` : "waiting for the connection";
}

function showStatus() {
  const s = chat.status, f = chat.failure;
  statusEl.dataset.status = s;
  statusEl.dataset.reason = f?.code ?? "";
  statusEl.textContent = s === "failed" ? LABELS[f?.code] ?? "failed" : s;
  const say = s !== "open" && f ? `${f.message[0].toUpperCase()}${f.message.slice(1)}. ${HINTS[f.code] ?? ""}` : "";
  notice.textContent = say.trim();
  notice.hidden = !say;
  const wantKey = s === "failed" && (f?.code === "unauthorized" || f?.code === "bad_key");
  keyInput.classList.toggle("wanted", wantKey);
  keyInput.setAttribute("aria-invalid", String(wantKey));
  // Ask for the key, unless that would take the keyboard from someone typing a message.
  if (wantKey && !(document.activeElement === input && input.value)) keyInput.focus();
  if (waitingNote) waitingNote.textContent = waitingText();
}

function connect() {
  const key = keyInput.value.trim();
  localStorage.setItem("edgechat.key", key);
  chat.key = key;
  chat.connect();  // the same client: requests waiting for it go out once it is open
}

function busy(on) {
  sendBtn.disabled = on;
  stopBtn.disabled = !on;
}

async function send(text) {
  const turn = history.length;
  history.push({role: "user", content: text});
  const asked = bubble("user", text);
  const el = bubble("assistant", "");
  const body = el.querySelector(".text");
  const view = new MarkdownView(body);
  const sampling = {max_tokens: Number($("max-tokens").value) || 256, temperature: Number($("temperature").value)};
  const req = current = chat.generate({messages: history.slice(), sampling});
  busy(true);
  let sent = req.sent;
  const streaming = () => {
    sent = true;
    el.dataset.state = "streaming";
    waitingNote?.remove();
    waitingNote = null;
  };
  if (sent) {
    streaming();
  } else {
    el.dataset.state = "queued";
    waitingNote = document.createElement("span");
    waitingNote.className = "note";
    el.append(waitingNote);
    showStatus();
  }
  req.onsend = () => { if (el.dataset.state === "queued") streaming(); };
  // The reply is drawn once a frame, not once a token: reading scrollHeight forces a
  // layout, and at a token every few ms those layouts took CPU the model was using. The
  // markdown is parsed again at most once a frame too (only its last block is rebuilt).
  let frame = 0;
  const draw = () => { frame = 0; view.update(req.text); el.dataset.tokens = req.tokens;
                       log.scrollTop = log.scrollHeight; };
  req.ondelta = () => { frame ||= requestAnimationFrame(draw); };
  try {
    await req.finished;
    cancelAnimationFrame(frame);
    draw();
    el.dataset.state = req.done.finish_reason === "abort" ? "stopped" : "done";
  } catch (e) {
    cancelAnimationFrame(frame);
    draw();
    el.dataset.state = "error";
    el.dataset.error = e.code;
    const err = document.createElement("span");
    err.className = "error";
    err.textContent = e.message;
    el.append(err);
  }
  if (!sent) {  // stopped before it ever went out: it is not part of the conversation
    waitingNote?.remove();
    waitingNote = null;
    history.splice(turn, 1);
    asked.dataset.state = "unsent";
    el.dataset.state = "unsent";
  }
  const s = req.stats();
  replies.push({...s, text: req.text});
  meta(el, s);
  if (req.text) history.push({role: "assistant", content: req.text});  // a stopped reply as far as it went
  if (current === req) { current = null; busy(false); }
}

window.edgechat = {client: chat, replies, history};
chat.addEventListener("status", showStatus);
$("connect").addEventListener("click", connect);
keyInput.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); connect(); } });
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || current) return;  // one reply at a time (Send is disabled meanwhile); the text stays
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
stopBtn.addEventListener("click", () => current?.cancel());
chat.connect();
