// markdown.js: a reply's markdown as DOM nodes, for the chat page. No dependencies.
//
// Safe by construction: the text only ever becomes text nodes (append(string) /
// textContent), never markup: nothing here parses HTML (no innerHTML, insertAdjacentHTML,
// DOMParser or document.write), so `<img onerror=...>` or `<script>` in a reply shows as
// those characters. The elements are the ones named below, made with createElement, and
// the only attributes set are an <a>'s href (absolute http: or https: URLs only, as the
// URL parser reads them; any other link stays the text it was written as), its rel and
// target, a <code>'s class (`language-` + letters, digits and -+_#. of the fence's info
// string), an <ol>'s start and a table cell's text-align (one of three words). Images
// become links: an <img> would fetch from wherever the model says.
//
// Markdown understood (CommonMark's common core, GitHub's tables, strike and bare URLs):
// ``` and ~~~ fences (unclosed: to the end, as while streaming), `code`, **strong**,
// __strong__, *em*, _em_, ~~strike~~, [text](url "title"), <url>, bare http(s) URLs,
// backslash escapes, - * + and 1. 1) lists (nested by indentation, loose or tight),
// # headings, > quotes, --- rules, | tables |, paragraphs in which every newline is a
// line break (a chat reply's lines are meant as lines).
//
// Cost: linear in the text, whatever it holds (a delimiter that finds no closer is
// remembered as such, nesting is cut at MAX_DEPTH), so a hostile reply cannot stall
// the page. MarkdownView re-renders a growing text (once a frame while streaming) and
// keeps the DOM of the leading top-level blocks whose source did not change: a frame
// rebuilds only the block that grew.

const MAX_DEPTH = 12;  // nested lists, quotes and emphasis deeper than this stay text

const FENCE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}>[ ]?(.*)$/;
const ITEM = /^([ \t]*)([-*+]|\d{1,9}[.)])(?:([ \t]+)(.*))?$/;
const TABLE_SEP = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
const LANG = /^[\w+#.-]{1,32}$/;

const blank = (line) => !line.trim();
const indentOf = (line) => line.match(/^[ \t]*/)[0].replace(/\t/g, "    ").length;

function dedent(line, n) {
  let i = 0, col = 0;
  while (i < line.length && col < n && (line[i] === " " || line[i] === "\t")) { col += line[i] === "\t" ? 4 : 1; i++; }
  return line.slice(i);
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  const cells = [];
  let cur = "";
  for (let i = 0; i < s.length; i++) {
    if (s[i] === "\\" && s[i + 1] === "|") { cur += "|"; i++; }
    else if (s[i] === "|") { cells.push(cur.trim()); cur = ""; }
    else cur += s[i];
  }
  cells.push(cur.trim());
  return cells;
}

function tableAt(lines, i) {
  return i + 1 < lines.length && lines[i].includes("|") && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")
    && splitRow(lines[i]).length === splitRow(lines[i + 1]).length;
}

// Does this line start a block other than a paragraph (so it ends the paragraph above)?
function interrupts(lines, i) {
  const l = lines[i];
  return FENCE.test(l) || HEADING.test(l) || RULE.test(l) || QUOTE.test(l) || tableAt(lines, i)
    || (ITEM.test(l) && ITEM.exec(l)[4] !== undefined && indentOf(l) < 4);
}

// Top-level blocks of `lines`: {kind, from (its first line), key, ...}. A block's rendering
// is a function of the block alone, so equal `key`s render equally (what MarkdownView's
// reuse rests on).
export function parseBlocks(lines, depth = 0) {
  const out = [];
  let i = 0;
  const push = (kind, from, to, extra) => out.push({kind, from, key: kind + "\0" + lines.slice(from, to).join("\n"),
                                                    ...extra});
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (blank(line)) { i++; continue; }
    if ((m = FENCE.exec(line))) {
      const [, ind, fence, info] = m;
      const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}[ \\t]*$`);
      let j = i + 1;
      while (j < lines.length && !close.test(lines[j])) j++;
      const body = lines.slice(i + 1, j).map((l) => dedent(l, ind.length));
      const end = Math.min(j + 1, lines.length);
      push("code", i, end, {lang: LANG.test(info) ? info : "", text: body.join("\n"), open: j >= lines.length});
      i = end;
    } else if ((m = HEADING.exec(line))) {
      push("heading", i, i + 1, {level: m[1].length, text: m[2] ?? ""});
      i++;
    } else if (RULE.test(line)) {
      push("rule", i, i + 1);
      i++;
    } else if (QUOTE.test(line) && depth < MAX_DEPTH) {
      const inner = [];
      let j = i;
      for (; j < lines.length; j++) {
        const q = QUOTE.exec(lines[j]);
        if (q) inner.push(q[1]);
        else if (!blank(lines[j]) && !blank(inner.at(-1) ?? "") && !interrupts(lines, j)) inner.push(lines[j]);  // lazy
        else break;
      }
      push("quote", i, j, {blocks: parseBlocks(inner, depth + 1)});
      i = j;
    } else if (ITEM.test(line) && indentOf(line) < 4 && depth < MAX_DEPTH) {
      i = parseList(lines, i, depth, push);
    } else if (tableAt(lines, i)) {
      const head = splitRow(lines[i]);
      const align = splitRow(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right")
                                                                       : c.startsWith(":") ? "left" : ""));
      let j = i + 2;
      const rows = [];
      while (j < lines.length && !blank(lines[j]) && lines[j].includes("|")) rows.push(splitRow(lines[j++]));
      push("table", i, j, {head, align, rows});
      i = j;
    } else {
      let j = i + 1;
      while (j < lines.length && !blank(lines[j]) && !interrupts(lines, j)) j++;
      push("paragraph", i, j, {text: lines.slice(i, j).map((l) => l.trim()).join("\n")});
      i = j;
    }
  }
  return out;
}

// One list from lines[i]: items of the same kind (bullet, or numbered with the same
// delimiter); lines indented past an item's marker, nested items, lazy lines and
// everything inside a fence opened in the item belong to the item.
function parseList(lines, i, depth, push) {
  const first = ITEM.exec(lines[i]);
  const ordered = /\d/.test(first[2]);
  const kindOf = (marker) => (/\d/.test(marker) ? marker.slice(-1) : marker);
  const kind = kindOf(first[2]);
  const base = indentOf(lines[i]);
  const items = [];
  let loose = false, j = i;
  while (j < lines.length) {
    const m = ITEM.exec(lines[j]);
    if (!m || kindOf(m[2]) !== kind || indentOf(lines[j]) > base + 3 || indentOf(lines[j]) < base) break;
    const spaces = m[3] ? m[3].replace(/\t/g, "    ").length : 1;
    const content = indentOf(lines[j]) + m[2].length + (spaces > 4 ? 1 : spaces);
    const body = [m[4] ?? ""];
    let fence = null;  // the closing pattern of a fence opened inside this item
    j++;
    while (j < lines.length) {
      const l = lines[j];
      if (fence) { body.push(dedent(l, content)); if (fence.test(l.trim())) fence = null; j++; continue; }
      if (blank(l)) {
        let k = j;
        while (k < lines.length && blank(lines[k])) k++;
        if (k < lines.length && indentOf(lines[k]) >= content) {  // the item goes on after the blank lines
          body.push(...lines.slice(j, k).map(() => ""));
          j = k;
          loose = true;
          continue;
        }
        const next = k < lines.length && ITEM.exec(lines[k]);
        if (next && kindOf(next[2]) === kind && indentOf(lines[k]) >= base && indentOf(lines[k]) <= base + 3) {
          loose = true;  // the next item of this list, after blank lines
          j = k;
        }
        break;
      }
      const ind = indentOf(l);
      const f = FENCE.exec(l);
      if (ind >= content || (ind > base && (ITEM.test(l) || f))) {  // part of this item (or nested under it)
        if (f) fence = new RegExp(`^${f[2][0] === "`" ? "`" : "~"}{${f[2].length},}$`);
        body.push(dedent(l, Math.min(ind, content)));
      } else if (ITEM.test(l) && ind <= base + 3) {
        break;  // the next item (or another list)
      } else if (!interrupts(lines, j) && !blank(body.at(-1))) {
        body.push(l.trim());  // a lazy continuation of the item's paragraph
      } else break;
      j++;
    }
    items.push(parseBlocks(body, depth + 1));
    if (j < lines.length && blank(lines[j])) break;  // a blank line not followed by this list's next item ends it
  }
  push("list", i, j, {ordered, start: ordered ? Number.parseInt(first[2], 10) : 1, items, loose});
  return j;
}

// -- rendering -------------------------------------------------------------------------

const el = (tag, ...children) => {
  const e = document.createElement(tag);
  e.append(...children);
  return e;
};

export function safeUrl(raw) {
  let u;
  try { u = new URL(raw); } catch { return null; }
  return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
}

function link(href, children, title = "") {
  const a = el("a", ...children);
  a.href = href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  if (title) a.title = title;
  return a;
}

export function renderBlock(b) {
  switch (b.kind) {
    case "code": {
      const code = el("code", b.text);
      if (b.lang) { code.className = "language-" + b.lang; code.dataset.lang = b.lang; }
      const pre = el("pre", code);
      if (b.open) pre.dataset.open = "";
      return pre;
    }
    case "heading": return el("h" + b.level, ...inline(b.text));
    case "rule": return el("hr");
    case "quote": return el("blockquote", ...b.blocks.map(renderBlock));
    case "paragraph": return el("p", ...inline(b.text));
    case "list": {
      const list = el(b.ordered ? "ol" : "ul");
      if (b.ordered && b.start !== 1) list.start = b.start;
      for (const blocks of b.items) {
        const li = el("li");
        blocks.forEach((c, n) => {
          // A tight item's paragraphs are its text, not <p>s.
          if (b.loose || c.kind !== "paragraph") li.append(renderBlock(c));
          else { if (n) li.append(el("br")); li.append(...inline(c.text)); }
        });
        list.append(li);
      }
      return list;
    }
    case "table": {
      const cell = (tag, text, n) => {
        const c = el(tag, ...inline(text ?? ""));
        if (b.align[n]) c.style.textAlign = b.align[n];
        return c;
      };
      const head = el("tr", ...b.head.map((t, n) => cell("th", t, n)));
      const body = b.rows.map((r) => el("tr", ...b.head.map((_, n) => cell("td", r[n], n))));
      const table = el("table", el("thead", head));
      if (body.length) table.append(el("tbody", ...body));
      return el("div", table);  // the div scrolls a wide table
    }
  }
  throw new Error(`unknown block ${b.kind}`);
}

const PUNCT = /[!-/:-@[-`{-~]/;
const WORD = /[\p{L}\p{N}]/u;
const SPACE = /\s/;
const BARE_URL = /https?:\/\/[^\s<>"`]+/iy;
const AUTOLINK = /<(https?:\/\/[^\s<>]+)>/iy;
// A link's (destination "title"): <anything> or no spaces with balanced parentheses (one level).
const PLAIN = String.raw`(?:[^\s()\\]|\\.)*`;  // destination characters: no space or parenthesis unless escaped
const DEST = new RegExp(String.raw`[ \t]*(?:<([^<>\n]*)>|(${PLAIN}(?:\(${PLAIN}\)${PLAIN})*))`
                        + String.raw`(?:[ \t]+("[^"\n]*"|'[^'\n]*'))?[ \t]*\)`, "y");

// Inline markdown of `s` as a list of nodes (strings are text nodes).
export function inline(s, depth = 0) {
  const out = [];
  let text = "";
  const flush = () => { if (text) out.push(text); text = ""; };
  const emit = (node) => { flush(); out.push(node); };
  const noCloser = new Set();  // delimiters with no closer after some earlier position: none after any later one
  let i = 0;
  while (i < s.length) {
    const c = s[i];
    if (c === "\\" && i + 1 < s.length && PUNCT.test(s[i + 1])) { text += s[i + 1]; i += 2; continue; }
    if (c === "\n") {  // a line break; the spaces around it go
      text = text.trimEnd();
      emit(document.createElement("br"));
      i++;
      while (s[i] === " " || s[i] === "\t") i++;
      continue;
    }
    if (c === "`") {
      let n = 1;
      while (s[i + n] === "`") n++;
      const close = noCloser.has("`" + n) ? -1 : findRun(s, "`", i + n, (k, r) => r === n);
      if (close < 0) { noCloser.add("`" + n); text += "`".repeat(n); i += n; continue; }
      let code = s.slice(i + n, close).replace(/\n/g, " ");
      if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
      emit(el("code", code));
      i = close + n;
      continue;
    }
    if (c === "[" || (c === "!" && s[i + 1] === "[")) {
      const got = depth < MAX_DEPTH && linkAt(s, i + (c === "!" ? 1 : 0), depth, noCloser);
      if (got) { emit(got.node); i = got.end; continue; }
      text += c; i++; continue;
    }
    if (c === "<") {
      AUTOLINK.lastIndex = i;
      const m = AUTOLINK.exec(s);
      const href = m && safeUrl(m[1]);
      if (href) { emit(link(href, [m[1]])); i = AUTOLINK.lastIndex; continue; }
      text += c; i++; continue;
    }
    if ((c === "h" || c === "H") && !(i && WORD.test(s[i - 1]))) {
      BARE_URL.lastIndex = i;
      const m = BARE_URL.exec(s);
      if (m) {
        const url = trimUrl(m[0]);
        const href = url.length > 8 && safeUrl(url);
        if (href) { emit(link(href, [url])); i += url.length; continue; }
        text += m[0]; i += m[0].length; continue;  // not a URL after all: text, not scanned again
      }
    }
    if (c === "*" || c === "_" || c === "~") {
      let n = 1;
      while (s[i + n] === c) n++;
      const got = depth < MAX_DEPTH && emphasisAt(s, i, c, n, depth, noCloser);
      if (got) { emit(got.node); i = got.end; continue; }
      text += c.repeat(n); i += n; continue;
    }
    text += c; i++;
  }
  flush();
  return out;
}

// A bare URL without the punctuation that ends its sentence, or the `)` that closes a
// parenthesis around it (one that opened inside the URL stays: .../Foo_(bar)).
function trimUrl(url) {
  let open = 0, close = 0;
  for (const ch of url) { if (ch === "(") open++; else if (ch === ")") close++; }
  let end = url.length;
  while (end > 0) {
    const ch = url[end - 1];
    if (ch === ")" && close > open) close--;
    else if (!".,:;!?'\"*_~".includes(ch)) break;
    end--;
  }
  return url.slice(0, end);
}

// The first run of `ch` at or after `from` (a maximal run, of length r at k) that `ok(k, r)` accepts; -1 if none.
function findRun(s, ch, from, ok) {
  let k = s.indexOf(ch, from);
  while (k >= 0) {
    let r = 1;
    while (s[k + r] === ch) r++;
    if (ok(k, r)) return k;
    k = s.indexOf(ch, k + r);
  }
  return -1;
}

// `*`, `_` or `~` delimiter run of length n at i: strong (2), em (1) or strike (~~), if a closer follows.
function emphasisAt(s, i, c, n, depth, noCloser) {
  if (c === "~" && n !== 2) return null;
  const after = s[i + n], before = i ? s[i - 1] : " ";
  if (after === undefined || SPACE.test(after)) return null;  // an opener is followed by a non-space
  if (c === "_" && WORD.test(before)) return null;  // snake_case is not emphasis
  for (const d of c === "~" ? [2] : n >= 2 ? [2, 1] : [1]) {
    const tag = c === "~" ? "del" : d === 2 ? "strong" : "em";
    const key = c + d;
    if (noCloser.has(key)) continue;
    // A closer: a run of c preceded by a non-space; for em a single (or triple+) run, so
    // `*a **b** c*` closes at the last `*`, not inside the strong.
    const k = findRun(s, c, i + n, (k, r) => !SPACE.test(s[k - 1]) && (d === 2 ? r >= 2 : r !== 2)
      && !(c === "_" && WORD.test(s[k + r] ?? "")) && !(c === "~" && r !== 2));
    if (k < 0) { noCloser.add(key); continue; }
    let r = 1;
    while (s[k + r] === c) r++;
    const innerStart = i + d, innerEnd = k + r - d;  // a longer closing run closes from its end (***x***)
    if (innerEnd <= innerStart) continue;
    return {node: el(tag, ...inline(s.slice(innerStart, innerEnd), depth + 1)), end: k + r};
  }
  return null;
}

// [text](url "title") at i (s[i] === "["); an image's `!` was before it. null unless an http(s) link.
function linkAt(s, i, depth, noCloser) {
  if (noCloser.has("]")) return null;
  const close = s.indexOf("]", i + 1);
  if (close < 0) { noCloser.add("]"); return null; }
  const open = s.indexOf("[", i + 1);
  if (open >= 0 && open < close) return null;  // not innermost: the inner `[` is tried on its own
  if (s[close + 1] !== "(") return null;
  DEST.lastIndex = close + 2;
  const m = DEST.exec(s);
  if (!m) return null;
  const href = safeUrl((m[1] ?? m[2]).replace(/\\(.)/g, "$1"));
  if (!href) return null;  // javascript:, data:, relative...: the source stays as text
  const label = s.slice(i + 1, close);
  const title = m[3] ? m[3].slice(1, -1) : s[i - 1] === "!" ? "image (not loaded)" : "";
  return {node: link(href, label ? inline(label, depth + 1) : [href], title),
          end: DEST.lastIndex};
}

// -- the view ------------------------------------------------------------------------------

// Renders a growing markdown text into `container` (an element or fragment), again and
// again: blocks whose source is unchanged keep their nodes. When the text only grew, the
// blocks before the last two are not even parsed again: text appended can change only the
// last two (a list taking another item after a blank line and a paragraph; a paragraph's
// last line becoming a table's header), every earlier one ended before them.
export class MarkdownView {
  constructor(container) {
    this.container = container;
    this.text = "";
    this.shown = [];  // [{key, from, node}] in order
  }

  update(text) {
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    const kept = text.startsWith(this.text) ? Math.max(0, this.shown.length - 2) : 0;
    const from = kept ? this.shown[kept].from : 0;
    const blocks = parseBlocks(from ? lines.slice(from) : lines);
    let k = 0;
    while (k < blocks.length && kept + k < this.shown.length && this.shown[kept + k].key === blocks[k].key) k++;
    for (const s of this.shown.splice(kept + k)) s.node.remove();
    for (const b of blocks.slice(k)) {
      const node = renderBlock(b);
      this.container.append(node);
      this.shown.push({key: b.key, from: from + b.from, node});
    }
    this.text = text;
  }
}

// The whole text at once, as a fragment.
export function render(text) {
  const f = document.createDocumentFragment();
  new MarkdownView(f).update(text);
  return f;
}
