"""Text that calibrates narrow (int8) prefill rows: the engine runs these chats through the
model once at start, every row wide, and each matmul keeps the input columns where it saw
the largest |x| out of a narrow row's int8 blocks (replica.model.cpu_model.CpuModel.calibrate).

Outlier columns are a property of the model (the same few channels carry large values
whatever the text), so a handful of short, varied chats is enough: on the default model,
columns fixed from 8 chats kept every held-out greedy answer of bench/activations.py
(docs/perf.md, "Prefill against the int8 peak"). Written for this purpose, in the shapes
users send: questions, instructions, code, arithmetic, a multi-turn exchange, other languages.
"""

from __future__ import annotations

from replica.tokenizer import ChatTemplateError

CHATS: list[list[dict]] = [
    [{"role": "user", "content": "What causes the seasons on Earth?"}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "If a train leaves at 3:40 pm and the trip takes 95 minutes, when does it arrive?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Give me three tips for a job interview."},
     {"role": "assistant", "content": "Research the company, prepare examples, and ask questions."},
     {"role": "user", "content": "Which one matters most?"}],
    [{"role": "user", "content": "Traduis en français : the weather is lovely today."}],
    [{"role": "user", "content": "Summarize the plot of Romeo and Juliet in two sentences."}],
    [{"role": "user", "content": "SELECT name, COUNT(*) FROM orders GROUP BY name; -- what does this query do?"}],
    [{"role": "user", "content": "List the planets of the solar system in order, with one fact about each."}],
]


def calibration_prompts(tokenizer, vocab_size: int) -> list[list[int]]:
    """CHATS as token ids, through the model's chat template (a model without one: their
    texts), or [] when the tokenizer's ids do not fit the model's vocabulary. `tokenizer`:
    a replica.tokenizer.Tokenizer, or a callable returning one (what the engine is given)."""
    if not hasattr(tokenizer, "encode_chat"):
        tokenizer = tokenizer()
    out = []
    for chat in CHATS:
        try:
            out.append(tokenizer.encode_chat(chat))
        except ChatTemplateError:
            out.append(tokenizer.encode("\n\n".join(m["content"] for m in chat)))
    return out if max(max(p) for p in out) < vocab_size else []
