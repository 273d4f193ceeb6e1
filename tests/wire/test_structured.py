"""response_format and vLLM's guided_* / structured_outputs as grammars, checked
token by token with the default model's tokenizer: what each accepts and refuses,
the JSON layout, and what is a 400 naming its field."""

import json

import msgspec
import pytest

from wire import openai as O
from wire import structured as S
from tests.wire.grammars import accepts


def grammar(**body) -> str:
    return O.parse_chat(msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], **body})).sampling.grammar


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"enum": ["x", "y"]},
                                                                           "maxItems": 2}},
          "required": ["a", "b"], "additionalProperties": False}


def test_response_format_kinds(tok):
    assert grammar() == "" and grammar(response_format={"type": "text"}) == ""
    obj = grammar(response_format={"type": "json_object"})
    assert accepts(tok, obj, '{"k": [1, {"z": null}], "s": "t"}') and not accepts(tok, obj, "[1, 2]")
    js = grammar(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}})
    assert accepts(tok, js, json.dumps({"a": 3, "b": ["x", "y"]}))
    assert not accepts(tok, js, json.dumps({"a": 3, "b": ["x", "y", "x"]}))  # maxItems
    assert not accepts(tok, js, json.dumps({"a": "3", "b": []}))
    assert not accepts(tok, js, '{"a": 3,"b": []}')  # json.dumps' layout: ", " and ": " only
    assert not accepts(tok, js, '{\n  "a": 3, "b": []}')


def test_whitespace_options(tok):
    flexible = grammar(guided_json=SCHEMA, guided_whitespace_pattern=r"[ \n]*")
    assert accepts(tok, flexible, '{\n "a" : 3 ,\n "b" : [ ] }')
    compact = grammar(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    assert accepts(tok, compact, '{"a":3,"b":["x"]}') and not accepts(tok, compact, '{"a": 3, "b": []}')


def test_vllm_fields(tok):
    assert accepts(tok, grammar(guided_regex=r"[0-9]{3}-[a-z]+"), "123-abc")
    assert not accepts(tok, grammar(guided_regex=r"[0-9]{3}-[a-z]+"), "12-abc")
    choice = grammar(guided_choice=["yes", "no way"])
    assert accepts(tok, choice, "no way") and not accepts(tok, choice, "maybe")
    lark = grammar(guided_grammar='start: "go " DIR\nDIR: "north" | "south"')
    assert accepts(tok, lark, "go north") and not accepts(tok, lark, "go west")
    gbnf = grammar(guided_grammar='root ::= "(" [0-9]+ ")"')
    assert accepts(tok, gbnf, "(42)") and not accepts(tok, gbnf, "(4a)")
    assert accepts(tok, grammar(structured_outputs={"regex": "a+b"}), "aab")
    assert accepts(tok, grammar(structured_outputs={"json_object": True}), '{"x": 1}')
    assert accepts(tok, grammar(guided_json=json.dumps(SCHEMA), guided_decoding_backend="guidance"),
                   '{"a": 1, "b": []}')
    comp = O.parse_completion(b'{"prompt": "x", "guided_choice": ["a", "b"]}')  # completions take them too
    assert accepts(tok, comp.sampling.grammar, "b")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "frob": 1}}},
     "response_format.json_schema.frob"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_refusals_name_their_field(body, param):
    with pytest.raises(O.OpenAIError) as e:
        grammar(**body)
    assert e.value.param == param, e.value.message


def test_a_schema_without_schema_allows_any_json(tok):
    g = S.response_format_grammar({"type": "json_schema", "json_schema": {"name": "anything"}}, S.JSON_LAYOUT)
    assert accepts(tok, g, "[1, 2]") and accepts(tok, g, '"s"')
