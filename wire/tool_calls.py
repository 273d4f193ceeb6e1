"""Tool calls parsed back out of a completion's text as it streams (no torch).

`ToolCallStream(format)` takes the text deltas of one choice and returns events:
content text (`str`), `CallStart(index, id, name)` once a call's name is read, and
`ArgsDelta(index, text)` as its arguments' JSON arrives -- the pieces of OpenAI's
streamed `tool_calls` deltas. The arguments are the model's own text of the JSON
value (not re-serialized), so the streamed pieces join into exactly the
`arguments` string of the whole answer.

  * hermes / edgechat: text outside `<tool_call>` ... `</tool_call>` blocks is
    content (whitespace around blocks dropped; a partial tag is held back until
    told apart from text); each block holds one call object.
  * llama3_json: an answer whose first non-blank character is `{` is calls (JSON
    objects, `;`-separated); anything else is content.

A call object's "name" is read as soon as it is complete; its "arguments" (llama3:
"parameters") stream from then on (if they came first, they are sent whole once the
name is known). A block that never yields a name is content after all.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from wire.tools import FunctionCall, ToolCall


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    index: int
    text: str


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _CallScanner:
    """Incremental scan of one JSON object: where its "name" and arguments values lie."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.text = ""
        self.pos = 0
        self.depth = 0  # brackets open, the call object's own included
        self.in_str = self.esc = False
        self.expect = "open"  # open | key | colon | value | comma (at the object's top level)
        self.key = ""
        self.start = -1  # where the current key or value began
        self.name: str | None = None
        self.args: tuple[int, int] | None = None  # (start, end or -1 while open)
        self.done = False
        self.bad = False  # not a call object

    def feed(self, s: str) -> None:
        self.text += s
        t = self.text
        while self.pos < len(t) and not (self.done or self.bad):
            c = t[self.pos]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 1:  # a top-level key or string value ends here
                        self._end(self.pos + 1)
            elif self.depth > 1:  # inside a nested value
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 1:
                        self._end(self.pos + 1)
            else:
                self._top(c)
            self.pos += 1

    def _top(self, c: str) -> None:
        """A character at the object's top level (depth 0 before it opens, 1 inside)."""
        e = self.expect
        if c.isspace() and e != "prim":
            return
        if e == "open":
            if c == "{":
                self.depth, self.expect = 1, "key"
            else:
                self.bad = True
        elif e in ("key", "comma") and c == "}":
            self.depth, self.done = 0, True
        elif e == "key" and c == '"':
            self.start, self.in_str = self.pos, True
        elif e == "colon" and c == ":":
            self.expect = "value"
        elif e == "value":
            self.start = self.pos
            if self.key in self.args_keys:
                self.args = (self.pos, -1)
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth = 2
            else:
                self.expect = "prim"  # a number or a literal: ends at , or }
        elif e == "prim":
            if c in ",}":
                self._end(self.pos, stripped=True)
                self._top(c)
        elif e == "comma" and c == ",":
            self.expect = "key"
        else:
            self.bad = True

    def _end(self, end: int, stripped: bool = False) -> None:
        """A top-level key or value spans text[start:end]."""
        raw = self.text[self.start:end]
        if stripped:
            end -= len(raw) - len(raw.rstrip())
            raw = raw.rstrip()
        if self.expect == "key":
            self.key, self.expect = json.loads(raw), "colon"
            return
        if self.key == "name" and raw.startswith('"'):
            self.name = json.loads(raw)
        if self.key in self.args_keys:
            self.args = (self.args[0], end)
        self.expect = "comma"

    def arguments(self) -> str:
        """The arguments' text so far."""
        if self.args is None:
            return ""
        start, end = self.args
        return self.text[start:] if end < 0 else self.text[start:end]


class ToolCallStream:
    def __init__(self, fmt: str, new_id=new_call_id):
        self.hermes = fmt in ("hermes", "edgechat")
        self.args_keys = ("arguments",) if self.hermes else ("parameters", "arguments")
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self.content = ""  # content sent so far
        self._buf = ""  # text not handled yet
        self._ws = ""  # trailing blanks of the content, held back (dropped if a call follows)
        self._after_call = False  # blanks right after a call are dropped too
        self._call: _CallScanner | None = None  # the call being read
        self._started = False  # CallStart sent for it
        self._sent = 0  # characters of its arguments sent
        self._id = ""
        self._mode = "calls"  # llama3_json: "calls" until the answer shows it is text, then "text"

    # -- input ---------------------------------------------------------------------------
    def feed(self, text: str) -> list:
        self._buf += text
        out: list = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list:
        """The end of the text: the open call (if any) ends, held text is content."""
        out: list = []
        while self._step(out, final=True):
            pass
        if self._call is not None:
            self._close_call(out, "")
        if self._buf:
            self._content(self._buf, out)
            self._buf = ""
        if self._ws and not self.calls:
            self._emit(self._ws, out)
        self._ws = ""
        return out

    # -- the state machine -------------------------------------------------------------
    def _step(self, out: list, final: bool) -> bool:
        """Handle what `_buf` allows; True to go on."""
        buf = self._buf
        if not buf:
            return False
        if self._call is not None:
            return self._in_call(out, final)
        if self.hermes:
            i = buf.find("<tool_call>")
            if i < 0:
                keep = 0 if final else _partial_suffix(buf, "<tool_call>")
                self._content(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                return False
            self._content(buf[:i], out)
            self._buf = buf[i + len("<tool_call>"):]
            self._open_call()
            return True
        if self._mode == "text":  # llama3_json
            self._content(buf, out)
            self._buf = ""
            return False
        rest = buf.lstrip()
        if self.calls:
            rest = rest.lstrip(";").lstrip()  # between calls
        if not rest:
            if final:
                self._buf = "" if self.calls else buf
            return False  # blanks so far: wait for the first character that tells
        if rest[0] == "{":
            self._buf = rest
            self._open_call()
        else:
            self._mode = "text"
        return True

    def _in_call(self, out: list, final: bool) -> bool:
        sc = self._call
        if self.hermes:
            j = self._buf.find("</tool_call>")
            if j < 0:
                keep = 0 if final else _partial_suffix(self._buf, "</tool_call>")
                sc.feed(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                self._progress(out)
                return False
            sc.feed(self._buf[:j])
            self._buf = self._buf[j + len("</tool_call>"):]
            self._close_call(out, "</tool_call>")
            return True
        before = len(sc.text)
        sc.feed(self._buf)
        if sc.done:
            self._buf = self._buf[sc.pos - before:]  # what follows the object
            sc.text = sc.text[: sc.pos]
        elif sc.bad:
            self._buf = ""  # all of it is content (`_close_call`)
        else:
            self._buf = ""
            self._progress(out)
            return False
        self._close_call(out, "")
        return True

    def _open_call(self) -> None:
        self._call = _CallScanner(self.args_keys)
        self._started, self._sent, self._id = False, 0, ""
        self._ws = ""  # blanks before a call are not content

    def _progress(self, out: list) -> None:
        sc = self._call
        if sc.name is None:
            return
        index = len(self.calls)
        if not self._started:
            self._started, self._id = True, self.new_id()
            out.append(CallStart(index, self._id, sc.name))
        args = sc.arguments()
        if len(args) > self._sent:
            out.append(ArgsDelta(index, args[self._sent:]))
            self._sent = len(args)

    def _close_call(self, out: list, tail: str) -> None:
        """The call being read ended (`tail`: the closing tag that ended it)."""
        sc = self._call
        self._progress(out)
        self._call = None
        if sc.name is None:  # never a call: its text is content
            self._content(("<tool_call>" if self.hermes else "") + sc.text + tail, out)
            if not self.hermes:
                self._mode = "text"
            return
        args = sc.arguments()
        if not args.strip() and sc.done:  # a whole call without arguments: an empty object
            args = "{}"
            out.append(ArgsDelta(len(self.calls), args))
        self.calls.append(ToolCall(self._id, FunctionCall(sc.name, args)))
        self._after_call = True

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        self._emit(self._ws + body, out)
        self._ws = text[len(body):]

    def _emit(self, text: str, out: list) -> None:
        if text:
            self.content += text
            out.append(text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
