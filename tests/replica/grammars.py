"""Structured-output requests on the tiny random Llama and its 97-token byte-level
tokenizer, shared by test_grammar and test_grammar_speculative: the grammars (a JSON
schema, a regex, a choice), each request's prompt, and the text of generated ids."""

import random

from tests.replica.tiny import tiny_tokenizer

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "axolotl"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "name": {"type": "string", "maxLength": 6},
    "owner": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 9}},
                                           "required": ["id"], "additionalProperties": False}]}},
    "required": ["kind", "age", "tags", "name", "owner"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]


def prompt(rid: str) -> list[int]:
    """Each request's own prompt, whatever else runs (str seeds hash the same in every process)."""
    rng = random.Random(rid)
    return [rng.randrange(1, 97) for _ in range(rng.randrange(4, 30))]


def text(ids) -> str:
    return tiny_tokenizer().decode([t for t in ids if t != 0])
