"""Structured output at the front door: OpenAI's `response_format` and vLLM's
`guided_*` / `structured_outputs` as one llguidance grammar (`SamplingParams.grammar`),
checked here so a bad schema, regex or grammar is a 400 naming its field.

Field library: llguidance (guidance-ai, Rust; pip `llguidance`). Both libraries
install from PyPI here and run on CPU; llguidance is the one taken because

  * its wheel has no dependencies (xgrammar 0.2.8 pulls transformers, triton and
    apache-tvm-ffi, and imports torch): the proxy, which never imports torch,
    builds and validates grammars with the same library the engine masks with;
  * it builds matchers in about a millisecond and computes a mask in tens of
    microseconds on this CPU without precomputing per-state token tables (see
    docs/perf.md), so an unseen schema costs one step nothing noticeable;
  * it reads every format the API takes: JSON Schema (well beyond OpenAI's strict
    subset: $ref/$defs, anyOf/oneOf, bounds on arrays, strings and numbers,
    patterns, formats), regexes, Lark and llama.cpp's GBNF, and JSON embedded in a
    grammar (`%json{...}`), which tool calling needs (wire.tools);
  * a matcher checks a list of tokens and rolls back (speculative drafts), and a
    deep copy shares the compiled grammar (the engine's per-schema cache).

JSON is generated in `json.dumps`' layout -- `", "` and `": "`, no other
whitespace -- unless the request asks otherwise (vLLM's `guided_whitespace_pattern`
/ `structured_outputs.whitespace_pattern`, `disable_any_whitespace`, or
`"x-guidance"` inside the schema): free whitespace lets a small model pad forever.
"""

from __future__ import annotations

import json

import llguidance
import msgspec

# What the schema layer raises: OpenAIError lives in wire.openai, which imports this
# module; the caller maps StructuredError(param, message) to its own 400.


class StructuredError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPACT_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
BACKENDS = ("auto", "guidance", "llguidance")  # vLLM's guided_decoding_backend values served here


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """vLLM's `structured_outputs` object (its newer spelling of the guided_* fields)."""

    json: object = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # there is one backend: nothing to fall back to
    disable_additional_properties: bool = False


# -- grammars -------------------------------------------------------------------------------
def json_schema_grammar(schema, layout: dict | None = None) -> str:
    """An llguidance grammar for JSON valid against `schema` (a dict, bool or JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not valid JSON: {e}") from None
    if schema is True:
        schema = {}  # any JSON value
    if not isinstance(schema, dict):
        raise ValueError("the schema false allows no value" if schema is False else
                         f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout or JSON_LAYOUT)


def json_object_grammar(layout: dict | None = None) -> str:
    return json_schema_grammar({"type": "object"}, layout)


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices are a non-empty list of non-empty strings")
    return llguidance.grammar_from("choice", choices)


def cfg_grammar(text: str) -> str:
    """A Lark grammar, or llama.cpp's GBNF (told apart by its `::=`)."""
    return llguidance.grammar_from("grammar", text)


def check(grammar: str, param: str) -> str:
    """`grammar` if llguidance can build it, else StructuredError naming `param`."""
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise StructuredError(param, f"{param}: {err}")
    return grammar


def _build(param: str, fn, *args) -> str:
    try:
        return check(fn(*args), param)
    except StructuredError:
        raise
    except (ValueError, TypeError, RuntimeError) as e:
        raise StructuredError(param, f"{param}: {e}") from None


# -- the request's fields -------------------------------------------------------------------
def _layout(whitespace_pattern: str | None, compact: bool = False) -> dict:
    if whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    return COMPACT_LAYOUT if compact else JSON_LAYOUT


def response_format_grammar(rf, layout: dict) -> str:
    """OpenAI's response_format: text (no grammar), json_object, json_schema."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredError("response_format", 'response_format is an object with a "type": "text", '
                                                 '"json_object" or "json_schema"')
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise StructuredError(f"response_format.{sorted(extra)[0]}", f"response_format takes type and json_schema, "
                                                                     f"not {sorted(extra)}")
    if kind == "text":
        return ""
    if kind == "json_object":
        return _build("response_format", json_object_grammar, layout)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "name" not in js:
            raise StructuredError("response_format.json_schema", 'json_schema is an object: {"name": ..., '
                                                                  '"schema": {...}, "strict": true}')
        unknown = set(js) - {"name", "description", "schema", "strict"}
        if unknown:
            raise StructuredError(f"response_format.json_schema.{sorted(unknown)[0]}",
                                  f"json_schema takes name, description, schema and strict, not {sorted(unknown)}")
        # OpenAI: a json_schema without "schema" allows any JSON value
        return _build("response_format.json_schema.schema", json_schema_grammar, js.get("schema", {}), layout)
    raise StructuredError("response_format.type", f"response_format.type must be text, json_object or json_schema, "
                                                  f"got {kind!r}")


FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_decoding_backend", "guided_whitespace_pattern")  # the request fields `grammar_of` reads


def grammar_of(response_format=None, structured_outputs: StructuredOutputs | None = None, guided_json=None,
               guided_regex: str | None = None, guided_choice: list[str] | None = None,
               guided_grammar: str | None = None, guided_decoding_backend: str | None = None,
               guided_whitespace_pattern: str | None = None) -> str:
    """The grammar a request's structured-output fields ask for ("" for none): OpenAI's
    response_format, vLLM's guided_* fields or its structured_outputs object. At most
    one may constrain the output."""
    if guided_decoding_backend is not None and guided_decoding_backend not in BACKENDS:
        raise StructuredError("guided_decoding_backend", f"guided_decoding_backend: this server runs llguidance; "
                                                         f"use one of {list(BACKENDS)}")
    so = structured_outputs
    ws = guided_whitespace_pattern if so is None or so.whitespace_pattern is None else so.whitespace_pattern
    layout = _layout(ws, so is not None and so.disable_any_whitespace)
    asked: list[tuple[str, object]] = []  # (param, builder)
    if response_format is not None:
        asked.append(("response_format", lambda: response_format_grammar(response_format, layout)))
    for name, value, fn in (("guided_json", guided_json, json_schema_grammar),
                            ("guided_regex", guided_regex, regex_grammar),
                            ("guided_choice", guided_choice, choice_grammar),
                            ("guided_grammar", guided_grammar, cfg_grammar)):
        if value is not None:
            args = (value, layout) if fn is json_schema_grammar else (value,)
            asked.append((name, lambda name=name, fn=fn, args=args: _build(name, fn, *args)))
    if so is not None:
        for name, fn in (("json", json_schema_grammar), ("regex", regex_grammar), ("choice", choice_grammar),
                         ("grammar", cfg_grammar)):
            value = getattr(so, name)
            if value is not None:
                args = (value, layout) if fn is json_schema_grammar else (value,)
                asked.append((f"structured_outputs.{name}",
                              lambda name=name, fn=fn, args=args: _build(f"structured_outputs.{name}", fn, *args)))
        if so.json_object:
            asked.append(("structured_outputs.json_object",
                          lambda: _build("structured_outputs.json_object", json_object_grammar, layout)))
    grammars = [(param, build()) for param, build in asked]
    grammars = [(param, g) for param, g in grammars if g]
    if len(grammars) > 1:
        raise StructuredError(grammars[1][0], f"give one structured-output constraint, not {[p for p, _ in grammars]}")
    return grammars[0][1] if grammars else ""
