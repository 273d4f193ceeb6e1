"""Grammars checked token by token with a real tokenizer (test_tools, test_structured)."""

import llguidance

from replica.engine.grammar import lark_tokenizer


def accepts(tok, grammar: str, text: str) -> bool:
    """Whether `grammar` (llguidance's lark) accepts `text`, then EOS, as `tok` encodes it."""
    m = llguidance.LLMatcher(lark_tokenizer(tok, 49152), grammar, log_level=0)
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]]
    return not m.is_error() and m.validate_tokens(ids) == len(ids)
