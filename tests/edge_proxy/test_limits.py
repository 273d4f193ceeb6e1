"""The proxy's limits (edge_proxy.limits), each checked by one function whichever front
end asks: at the limit passes, one past it is refused with its code and a message that
names the limit."""

import pytest

from edge_proxy import protocol as pp
from edge_proxy.limits import (Limits, check_frame_size, check_message_count, check_open_requests, check_prompt,
                               check_prompt_tokens, check_session_id)


def refused(fn, *args) -> pp.ProtocolError:
    with pytest.raises(pp.ProtocolError) as e:
        fn(*args)
    return e.value


def test_one_message_count_limit_for_both_shapes():
    lim = Limits(max_messages=3)
    check_message_count(3, lim)  # the WebSocket counts its Message structs as soon as they decode
    ws = refused(check_message_count, 4, lim)
    chat = [{"role": "user", "content": "x"}] * 4  # the OpenAI API's dicts (and the WebSocket's, converted)
    check_prompt(chat[:3], None, lim)
    http = refused(check_prompt, chat, None, lim)
    assert ws.code == http.code == pp.PROMPT_TOO_LONG and ws.message == http.message == \
        "4 messages; at most 3 are accepted"


def test_prompt_tokens_against_the_proxy_and_the_context():
    check_prompt_tokens(10, 6, 10, 16)
    assert refused(check_prompt_tokens, 0, 6, 0, 0).code == pp.BAD_REQUEST  # empty
    e = refused(check_prompt_tokens, 11, 1, 10, 0)
    assert e.code == pp.PROMPT_TOO_LONG and "at most 10" in e.message
    e = refused(check_prompt_tokens, 10, 7, 0, 16)
    assert e.code == pp.PROMPT_TOO_LONG and "context of 16 tokens" in e.message
    check_prompt_tokens(10**6, 10**6, 0, 0)  # no limit of the proxy's, the context not known yet


def test_session_frame_and_open_requests():
    check_session_id("s" * pp.MAX_SESSION_CHARS)
    assert refused(check_session_id, "").code == refused(check_session_id, "s" * 257).code == pp.BAD_REQUEST
    check_frame_size(1024, 1024)
    assert refused(check_frame_size, 1025, 1024).code == pp.TOO_LARGE
    check_open_requests(15, 16)
    e = refused(check_open_requests, 16, 16)
    assert e.code == pp.RATE_LIMITED and e.retry_after_s == 1.0
