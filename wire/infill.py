"""llama.cpp's `POST /infill`, as llama.vim and llama.vscode send it (no torch).

Request fields honoured: input_prefix, input_suffix, input_extra ([{filename,
text}], repo-level context), prompt (text already typed after the prefix),
n_predict (-1: the service's default; 0: only warm the prefix cache: the prompt
is prefilled and the one token computed is dropped), stream, temperature, top_k,
top_p, min_p, seed, stop, presence/frequency penalties, repeat_penalty, ignore_eos,
n_indent (stop at a line indented less, cut before it), t_max_predict_ms (stop
once that long has passed since the first token and a newline was generated) and
response_fields (the answer holds only those, flat "a/b" keys as llama.cpp does).
Accepted with no effect on the output: cache_prompt (the prefix cache is always
on), samplers (the order is fixed: penalties, min_p, top-k, top-p, temperature),
id_slot (there are no slots), t_max_prompt_ms (llama.cpp does not enforce it
either), model. Anything else is a 400 naming it.

Answer: {"content", "stop", "stop_type" (eos | limit | word), "stopping_word",
"tokens_predicted", "tokens_evaluated", "tokens_cached", "truncated", "model",
"timings": {prompt_n, prompt_ms, prompt_per_token_ms, prompt_per_second,
predicted_n, predicted_ms, predicted_per_token_ms, predicted_per_second}};
streaming sends `data: {"content": ..., "stop": false}` lines, then the full
answer with "stop": true.
"""

from __future__ import annotations

import time

import msgspec

from wire import protocol as P
from wire.openai import Fim, OpenAIError, Plan, check_sampling, decode

_enc = msgspec.json.Encoder()


class ExtraChunk(msgspec.Struct):
    filename: str = ""
    text: str = ""


class InfillRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""
    n_predict: int = -1
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = []
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    ignore_eos: bool = False
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    response_fields: list[str] | None = None
    # accepted, no effect on the output (see the module docstring)
    cache_prompt: bool = True
    samplers: list[str] | None = None
    id_slot: int | None = None
    t_max_prompt_ms: float | None = None
    model: str | None = None


def parse(body: bytes) -> tuple[Plan, InfillRequest]:
    r = decode(body, InfillRequest)
    if not -1 <= r.n_predict <= 1 << 20:
        raise OpenAIError(f"n_predict must be -1, 0 or positive, got {r.n_predict}", "n_predict")
    if not 0 <= r.n_indent <= 1 << 10 or not 0 <= r.t_max_predict_ms <= 3.6e6:
        raise OpenAIError("n_indent must be in [0, 1024] and t_max_predict_ms in [0, 3600000]", "n_indent")
    kw = dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, seed=r.seed,
              presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
              repetition_penalty=r.repeat_penalty)
    kw = {k: v for k, v in kw.items() if v is not None}
    if kw.get("temperature", 1.0) < 0:
        kw["temperature"] = 0.0  # llama.cpp: a negative temperature is greedy
    max_tokens = P.DEFAULT_MAX_TOKENS if r.n_predict < 0 else max(1, r.n_predict)
    sp = check_sampling(P.SamplingParams(max_tokens=max_tokens, stop=list(r.stop), ignore_eos=r.ignore_eos, **kw))
    fim = Fim(r.input_prefix, r.input_suffix, [(c.filename, c.text) for c in r.input_extra], r.prompt)
    return Plan("infill", [fim], sp, r.model, stream=r.stream), r


class InfillStop:
    """n_indent and t_max_predict_ms: text-level stops applied as the answer grows."""

    def __init__(self, r: InfillRequest):
        self.n_indent, self.t_max_s = r.n_indent, r.t_max_predict_ms / 1e3
        self.t_first = 0.0
        self.text = ""

    def cut(self, text: str) -> str | None:
        """The answer's new text; None to keep going, else the text to keep before stopping."""
        now = time.perf_counter()
        self.t_first = self.t_first or now
        whole = self.text + text
        if self.n_indent:
            start = 0
            while (nl := whole.find("\n", start)) >= 0:
                line = whole[nl + 1:]
                stripped = line.lstrip(" \t")
                if stripped and len(line) - len(stripped) < self.n_indent:  # as llama.cpp: cut after the indent
                    return whole[: nl + 1 + len(line) - len(stripped)][len(self.text):]
                if not stripped and "\n" not in line:
                    break  # the line is not written yet
                start = nl + 1
        self.text = whole
        if self.t_max_s and now - self.t_first > self.t_max_s and "\n" in whole:
            return text
        return None


class InfillResponse:
    """One /infill request's answer; the same interface as wire.openai_render.Response.
    When `cut` turns true (n_indent, t_max_predict_ms) the caller aborts the generation."""

    def __init__(self, plan: Plan, r: InfillRequest, model: str, n_prompt: int):
        self.plan, self.model, self.n_prompt = plan, model, n_prompt
        self.fields = r.response_fields
        self.warmup = r.n_predict == 0  # prefill only: the token computed is dropped
        self.stopper = InfillStop(r)
        self.t0 = time.perf_counter()
        self.t_first = self.t_end = 0.0
        self.content: list[str] = []
        self.ntok = 0
        self.cached = 0
        self.reason = ""
        self.cut = False
        self.extra: dict | None = None

    def start(self) -> bytes:
        return b""

    def message(self, p: int, msg, hold: bool = False) -> bytes:
        if self.reason:
            return b""
        now = time.perf_counter()
        self.t_first = self.t_first or now
        text = "" if self.warmup else msg.text
        self.ntok += 0 if self.warmup else len(msg.ids)
        if text and not self.cut:
            kept = self.stopper.cut(text)
            if kept is not None:
                text, self.cut = kept, True
        self.content.append(text)
        out = event({"content": text, "stop": False}) if self.plan.stream and text else b""
        if self.cut:
            self.reason = P.FINISH_LENGTH
        elif type(msg) is P.Finished:
            self.cached = msg.usage.cached_tokens
            if not hold:
                self.reason = msg.finish_reason
        return out

    def end(self, p: int, reason: str) -> bytes:
        self.reason = self.reason or reason
        return b""

    @property
    def done(self) -> bool:
        return bool(self.reason)

    def _answer(self) -> dict:
        self.t_end = self.t_end or time.perf_counter()
        return select(answer("".join(self.content), stop=True, stop_type=stop_type(self.reason, ""),
                             stop_word="", n_prompt=self.n_prompt, n_cached=self.cached, n_predicted=self.ntok,
                             t0=self.t0, t_first=self.t_first or self.t_end, t_end=self.t_end, model=self.model),
                      self.fields)

    def close(self) -> bytes:
        return event({**self._answer(), "content": ""})

    def answer(self) -> bytes:
        return _enc.encode(self._answer())


def answer(content: str, *, stop: bool, stop_type: str, stop_word: str, n_prompt: int, n_cached: int,
           n_predicted: int, t0: float, t_first: float, t_end: float, model: str) -> dict:
    prompt_ms = max((t_first - t0) * 1e3, 1e-3)
    predict_ms = max((t_end - t_first) * 1e3, 1e-3)
    return {"content": content, "stop": stop, "stop_type": stop_type, "stopping_word": stop_word,
            "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt, "tokens_cached": n_cached,
            "truncated": False, "model": model,
            "timings": {"prompt_n": n_prompt - n_cached, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / max(1, n_prompt - n_cached),
                        "prompt_per_second": 1e3 * (n_prompt - n_cached) / prompt_ms,
                        "predicted_n": n_predicted, "predicted_ms": predict_ms,
                        "predicted_per_token_ms": predict_ms / max(1, n_predicted),
                        "predicted_per_second": 1e3 * n_predicted / predict_ms}}


def select(obj: dict, fields: list[str] | None) -> dict:
    """llama.cpp's response_fields: only those, keyed by their "a/b" paths."""
    if fields is None:
        return obj
    out = {}
    for path in fields:
        v = obj
        for part in path.split("/"):
            if not isinstance(v, dict) or part not in v:
                break
            v = v[part]
        else:
            out[path] = v
    return out


def event(obj: dict) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def stop_type(finish_reason: str, stop_word: str) -> str:
    return "word" if stop_word else ("limit" if finish_reason == P.FINISH_LENGTH else "eos")
