// The chat page: a conversation over EdgeChat (edgechat.js), streamed as it arrives,
// with a stop button, per-message TTFT, tokens/s, region and replica, and reconnects.
// window.edgechat exposes the client and every reply's figures (tests, bench/clients.py).
import {EdgeChat} from "./edgechat.js";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("message"), sendBtn = $("send"), stopBtn = $("stop"), statusEl = $("status");
const keyInput = $("key");
keyInput.value = localStorage.getItem("edgechat.key") ?? "";

const history = [];  // {role, content}: what the next turn sends
const replies = [];  // per assistant message: Request.stats() once it ended
let chat = null;
let current = null;  // the request streaming now

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("span");
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

function connect() {
  chat?.close();
  localStorage.setItem("edgechat.key", keyInput.value);
  chat = new EdgeChat({key: keyInput.value});
  chat.addEventListener("status", (e) => { statusEl.textContent = e.detail; statusEl.dataset.status = e.detail; });
  chat.connect();
  window.edgechat.client = chat;
}

async function send(text) {
  if (!chat) connect();
  history.push({role: "user", content: text});
  bubble("user", text);
  const el = bubble("assistant", "");
  el.dataset.state = "streaming";
  const body = el.querySelector(".text");
  const sampling = {max_tokens: Number($("max-tokens").value) || 256, temperature: Number($("temperature").value)};
  const req = current = chat.generate({messages: history.slice(), sampling});
  // The reply is drawn once a frame, not once a token: reading scrollHeight forces a
  // layout, and at a token every few ms those layouts took CPU the model was using.
  let frame = 0;
  const draw = () => { frame = 0; body.textContent = req.text; el.dataset.tokens = req.tokens;
                       log.scrollTop = log.scrollHeight; };
  req.ondelta = () => { frame ||= requestAnimationFrame(draw); };
  stopBtn.disabled = false;
  try {
    await req.finished;
    cancelAnimationFrame(frame);
    draw();
    el.dataset.state = req.done.finish_reason === "abort" ? "stopped" : "done";
  } catch (e) {
    cancelAnimationFrame(frame);
    el.dataset.state = "error";
    el.dataset.error = e.code;
    body.textContent = req.text + (req.text ? "\n" : "") + `[${e.message}]`;
  }
  const s = req.stats();
  replies.push(s);
  meta(el, s);
  if (req.text) history.push({role: "assistant", content: req.text});  // a stopped reply as far as it went
  if (current === req) { current = null; stopBtn.disabled = true; }
}

window.edgechat = {client: null, replies, history};
$("connect").addEventListener("click", connect);
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || current) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
stopBtn.addEventListener("click", () => current?.cancel());
connect();
