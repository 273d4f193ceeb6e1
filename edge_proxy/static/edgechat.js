// edgechat.js: the public WebSocket protocol (docs/protocol.md) for browsers.
// No build step, no dependencies, nothing fetched from anywhere but the page's own origin.
//
//   const chat = new EdgeChat({key: "sk-..."});          // ws(s)://<this host>/v1/stream
//   const req = chat.generate({messages, sampling: {max_tokens: 256}});
//   req.ondelta = (text) => ...;  const done = await req.finished;   // rejects with EdgeError
//   req.cancel();
//
// Authentication rides in the subprotocol offer ["edgechat.v1", "bearer.<key>"] (browsers
// cannot set headers on a WebSocket). When the socket closes (the proxy restarted or
// drained, the network went), the client reconnects with capped exponential backoff and
// full jitter and sends every open request again with `resume` = the token ids it already
// received: requests go out `resumable` with a seed, so the text continues exactly.

export class EdgeError extends Error {
  constructor(code, message, retryAfterS) {
    super(`${code}: ${message}`);
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

const RESUMED = new Set(["shutting_down"]);  // cut or refused by a draining proxy: resume elsewhere

function randomSeed() {
  const a = new Uint32Array(2);
  crypto.getRandomValues(a);
  return (a[0] & 0x3fffffff) * 2 ** 32 + a[1];  // < 2**62: exact in a double, within the protocol's [0, 2**63)
}

export class Request {
  constructor(chat, frame) {
    this.chat = chat;
    this.id = frame.id;
    this.frame = frame;  // the generate, sent again (with `resume`) after a reconnect
    this.text = "";
    this.ids = [];
    this.tokens = 0;
    this.sent = false;  // on the current socket
    this.resumes = 0;
    this.tSend = performance.now();
    this.tFirst = 0;
    this.tLast = 0;
    this.gaps = [];  // ms between consecutive deltas, as this page received them
    this.done = null;
    this.ondelta = null;  // (text, request) => void
    this.finished = new Promise((resolve, reject) => { this._resolve = resolve; this._reject = reject; });
    this.finished.catch(() => {});  // a caller that never awaits it must not see an unhandled rejection
  }

  cancel() {
    if (this.done) return;
    if (this.sent && this.chat.ws?.readyState === WebSocket.OPEN) {
      this.chat.send({type: "cancel", id: this.id});
    } else {
      this._end({type: "done", id: this.id, finish_reason: "abort", usage: {}, timing: {}, region: "", replica: ""});
    }
  }

  stats() {
    const ttft = this.tFirst ? this.tFirst - this.tSend : null;
    const span = this.tLast - this.tFirst;
    return {
      ttft_ms: ttft, tokens: this.tokens, gaps_ms: this.gaps.slice(),
      tokens_per_s: this.tokens > 1 && span > 0 ? (this.tokens - 1) * 1000 / span : null,
      region: this.done?.region ?? "", replica: this.done?.replica ?? "",
      finish_reason: this.done?.finish_reason ?? "", resumes: this.resumes,
    };
  }

  _delta(m) {
    const now = performance.now();
    if (this.tFirst) this.gaps.push(now - this.tLast); else this.tFirst = now;
    this.tLast = now;
    this.text += m.text;
    this.tokens += m.tokens;
    if (m.ids) this.ids.push(...m.ids);
    this.ondelta?.(m.text, this);
  }

  _end(m) {
    this.chat.requests.delete(this.id);
    if (m.type === "done") {
      this.done = m;
      this._resolve(m);
    } else {
      this.done = {finish_reason: "error", error: m};
      this._reject(new EdgeError(m.code, m.message, m.retry_after_s));
    }
  }
}

export class EdgeChat extends EventTarget {
  constructor({url = null, key = "", backoff = {initialS: 0.2, maxS: 5}} = {}) {
    super();
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    this.url = url ?? `${scheme}//${location.host}/v1/stream`;
    this.key = key;
    this.backoff = backoff;
    this.requests = new Map();
    this.status = "closed";  // connecting | open | reconnecting | closed
    this.reconnects = 0;
    this.ws = null;
    this._attempt = 0;
    this._timer = null;
    this._seq = 0;
    this._stopped = false;
    this._wasOpen = false;
  }

  connect() {
    this._stopped = false;
    clearTimeout(this._timer);
    this._setStatus(this.status === "closed" ? "connecting" : "reconnecting");
    const offer = ["edgechat.v1"];
    if (this.key) offer.push("bearer." + this.key);
    const ws = this.ws = new WebSocket(this.url, offer);
    ws.onopen = () => {
      if (ws !== this.ws) return;
      if (this._wasOpen) this.reconnects += 1;
      this._wasOpen = true;
      this._attempt = 0;
      this._setStatus("open");
      for (const r of this.requests.values()) if (!r.sent) this._sendRequest(r);
    };
    ws.onmessage = (ev) => this._frame(JSON.parse(ev.data));
    ws.onclose = () => {
      if (ws !== this.ws) return;
      for (const r of this.requests.values()) r.sent = false;  // resumed on the next socket
      if (this._stopped) { this._setStatus("closed"); return; }
      if (!this._wasOpen && this._attempt >= 2) {  // never got in (a wrong key looks the same): stop knocking
        this._setStatus("failed");
        for (const r of [...this.requests.values()]) r._end({type: "error", id: r.id, code: "unavailable",
                                                             message: "cannot connect; check the API key"});
        return;
      }
      this._setStatus("reconnecting");
      const b = this.backoff;
      const delay = Math.random() * Math.min(b.maxS, b.initialS * 2 ** Math.min(this._attempt, 20));
      this._attempt += 1;
      this._timer = setTimeout(() => this.connect(), delay * 1000);
    };
  }

  close() {
    this._stopped = true;
    clearTimeout(this._timer);
    this.ws?.close();
  }

  generate({messages = null, prompt = null, sampling = {}, session = null, id = null, replaces = null} = {}) {
    id ??= `m${++this._seq}`;
    const frame = {type: "generate", id, resumable: true, sampling: {...sampling}};
    if (frame.sampling.seed == null) frame.sampling.seed = randomSeed();
    if (messages) frame.messages = messages; else frame.prompt = prompt;
    if (session) frame.session = session;
    const old = replaces && this.requests.get(replaces.id ?? replaces);
    if (old?.sent) frame.replaces = old.id; else old?.cancel();
    const req = new Request(this, frame);
    this.requests.set(id, req);
    if (this.ws?.readyState === WebSocket.OPEN) this._sendRequest(req, frame.replaces);
    return req;
  }

  send(msg) {
    this.ws.send(JSON.stringify(msg));
  }

  _sendRequest(req, replaces) {
    const frame = {...req.frame};
    delete frame.replaces;
    if (replaces) frame.replaces = replaces;
    if (req.ids.length) { frame.resume = req.ids.slice(); req.resumes += 1; }
    req.sent = true;
    this.send(frame);
  }

  _frame(m) {
    const req = m.id != null ? this.requests.get(m.id) : undefined;
    if (!req || !req.sent) {
      if (m.type === "error" && m.id == null) this.dispatchEvent(new CustomEvent("error", {detail: m}));
      return;
    }
    if (m.type === "delta") req._delta(m);
    else if (m.type === "error" && RESUMED.has(m.code)) req.sent = false;  // the proxy drains: next socket
    else req._end(m);
  }

  _setStatus(s) {
    this.status = s;
    this.dispatchEvent(new CustomEvent("status", {detail: s}));
  }
}
