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
//
// A request made while the socket is not open waits, and goes out once it is (req.sent;
// req.onsend is called each time it is sent). Nothing is dropped while the client cannot
// connect: requests wait until it can or until they are cancelled.
//
// Why a connection fails: a browser tells a script nothing about a refused handshake (the
// proxy's 401 and its JSON body are hidden; onclose says 1006). So when a socket closes
// before it opened, the client asks the same server `GET /v1/models` with the same key,
// where the status is readable, and sets `chat.failure` = {code, message}:
//   unauthorized (401: no key, or a key the server does not know) and forbidden (403) are
//     final: status `failed`, no more attempts until connect() is called again (say, with
//     another `chat.key`);
//   rate_limited (429: too many failed authentications from this address): the next
//     attempt waits the server's Retry-After;
//   unreachable (no answer) and unavailable (it answers, but the socket still failed):
//     retried with backoff, status `reconnecting`.
// A key that cannot ride in a subprotocol (only RFC 7230 token characters can) is refused
// at once: bad_key.

export class EdgeError extends Error {
  constructor(code, message, retryAfterS) {
    super(`${code}: ${message}`);
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

const RESUMED = new Set(["shutting_down"]);  // cut or refused by a draining proxy: resume elsewhere
const KEY_CHARS = /^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/;  // a subprotocol is an RFC 7230 token

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
    this.wentOut = false;  // on any socket: TTFT counts from then, not from a wait for the connection
    this.resumes = 0;
    this.tSend = performance.now();
    this.tFirst = 0;
    this.tLast = 0;
    this.gaps = [];  // ms between consecutive deltas, as this page received them
    this.done = null;
    this.ondelta = null;  // (text, request) => void
    this.onsend = null;  // (request) => void: it went out on a socket (again, after a reconnect)
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
    this.status = "closed";  // connecting | open | reconnecting | failed | closed
    this.failure = null;  // why the last attempt failed: {code, message, retryAfterS?}; null once open
    this.reconnects = 0;
    this.ws = null;
    this._attempt = 0;
    this._timer = null;
    this._seq = 0;
    this._stopped = false;
    this._wasOpen = false;
  }

  // Connect now (again: with a changed `key`, say). A socket still open or opening is
  // dropped first; its open requests are sent again, resumed, on the new one.
  connect() {
    this._stopped = false;
    this._attempt = 0;
    this._open("connecting");
  }

  _open(status) {
    clearTimeout(this._timer);
    this._retire();
    if (this.key && !KEY_CHARS.test(this.key)) {
      this._fail({code: "bad_key",
                  message: "that API key has characters an API key cannot have (spaces, quotes, non-ASCII...)"});
      return;
    }
    this._setStatus(status);
    const offer = ["edgechat.v1"];
    if (this.key) offer.push("bearer." + this.key);
    const ws = this.ws = new WebSocket(this.url, offer);
    let opened = false;
    ws.onopen = () => {
      if (ws !== this.ws) return;
      opened = true;
      if (this._wasOpen) this.reconnects += 1;
      this._wasOpen = true;
      this._attempt = 0;
      this.failure = null;
      this._setStatus("open");
      for (const r of this.requests.values()) if (!r.sent) this._sendRequest(r);
    };
    ws.onmessage = (ev) => { if (ws === this.ws) this._frame(JSON.parse(ev.data)); };
    ws.onclose = async () => {
      if (ws !== this.ws) return;
      for (const r of this.requests.values()) r.sent = false;  // resumed on the next socket
      if (this._stopped) { this._setStatus("closed"); return; }
      let wait = null;
      if (!opened) {  // refused, or nobody there: find out which
        const why = await this._diagnose();
        if (ws !== this.ws || this._stopped) return;  // connect() or close() came meanwhile
        if (why.final) { this._fail(why); return; }
        this.failure = why;
        wait = why.retryAfterS ?? null;
      }
      const b = this.backoff;
      wait ??= Math.random() * Math.min(b.maxS, b.initialS * 2 ** Math.min(this._attempt, 20));
      this._attempt += 1;
      this._setStatus("reconnecting");
      this._timer = setTimeout(() => this._open("reconnecting"), wait * 1000);
    };
  }

  // The socket of this client, if any, let go of: nothing it does reaches us any more.
  _retire() {
    const old = this.ws;
    if (!old) return;
    this.ws = null;
    old.onopen = old.onmessage = old.onclose = null;
    if (old.readyState === WebSocket.CONNECTING || old.readyState === WebSocket.OPEN) old.close();
    for (const r of this.requests.values()) r.sent = false;
  }

  _fail(failure) {
    this.failure = failure;
    this._setStatus("failed");
  }

  // Why a handshake failed, asked of the same server over HTTP with the same key.
  async _diagnose() {
    const u = new URL(this.url);
    u.protocol = u.protocol === "wss:" ? "https:" : "http:";
    u.pathname = "/v1/models";
    u.search = "";
    let r;
    try {
      r = await fetch(u, {headers: this.key ? {Authorization: `Bearer ${this.key}`} : {}, cache: "no-store"});
    } catch {
      return {code: "unreachable", message: "cannot reach the server; retrying"};
    }
    if (r.status === 401) {
      return {code: "unauthorized", final: true,
              message: this.key ? "this server does not know that API key" : "this server needs an API key"};
    }
    if (r.status === 403) return {code: "forbidden", final: true, message: "this server refuses this page's origin"};
    if (r.status === 429) {
      const s = Math.max(1, Number(r.headers.get("Retry-After")) || 1);
      return {code: "rate_limited", retryAfterS: s,
              message: `too many failed attempts from this address; trying again in ${s} s`};
    }
    return {code: "unavailable", message: `the server answers (HTTP ${r.status}) but refused the connection; retrying`};
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
    if (!req.wentOut) { req.wentOut = true; req.tSend = performance.now(); }
    req.sent = true;
    this.send(frame);
    req.onsend?.(req);
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
