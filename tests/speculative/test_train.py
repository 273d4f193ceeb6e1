"""Training: the training-time-test unroll computes what drafting computes, a
tiny head learns (loss goes down), checkpoints resume, heads save and load."""

import json

import pytest
import torch

import kernels
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.scheduler import Scheduler
from replica.model.cpu_model import CpuModel
from replica.model.plan import Sampling, StepPlan
from replica.model.runner import Runner, build_model
from wire import protocol as P
from speculative.cache import head_dir
from speculative.drafting import Drafter
from speculative.tree_spec import TreeSpec
from speculative.head import HeadConfig, aux_layers_for, save_head
from speculative.loading import load_head
from replica.tokenizer import Tokenizer
from speculative.train import (DATA_FILE, STATE_FILE, batches, build_data, data_key, draft_vocab, init_head,
                               load_data, load_prompts, output_weight, self_distill, train, ttt_unroll,
                               user_turn_opening, write_user_turns)
from tests.replica.tiny import tiny_config, tiny_tokenizer, tiny_weights
from tests.speculative.util import random_head, tiny_target


@pytest.fixture(scope="module")
def data():
    """Self-distillation data from the tiny target: its own greedy answers."""
    model = tiny_target(eos_token_ids=())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 97, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (12,), generator=g)]
    convs = self_distill(model, prompts, aux_layers_for(4), max_tokens=24, temperature=0.0, seed=0, batch_size=5)
    return model, {k: [c[k] for c in convs] for k in ("ids", "n_prompt", "aux", "hidden", "top1")}


def test_self_distillation_records_what_the_target_computes(data):
    """Answers are the engine's greedy tokens; recorded features are those of a fresh forward."""
    model, d = data
    prompts = [ids[:n].tolist() for ids, n in zip(d["ids"], d["n_prompt"])]
    engine = LLMEngine(EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32), model.cfg,
                       model=model, ops=model.ops)
    for i, p in enumerate(prompts):
        engine.add(P.Generate(id=str(i), prompt_ids=p, sampling=P.SamplingParams(max_tokens=24, temperature=0.0)))
    answers = [[] for _ in prompts]
    while engine.has_work():
        for m in engine.step():
            answers[int(m.id)].extend(m.ids)
    for i, (ids, a) in enumerate(zip(d["ids"], answers)):
        assert ids.tolist() + [int(d["top1"][i][-1])] == prompts[i] + a  # the last token is never processed
        assert d["aux"][i].shape == (len(ids), 3 * model.cfg.hidden_size) and d["hidden"][i].shape == (len(ids), 48)
    ref = self_distill(model, [d["ids"][0].tolist()], aux_layers_for(4), max_tokens=1, temperature=0.0, seed=0)[0]
    torch.testing.assert_close(ref["aux"], d["aux"][0], atol=2e-3, rtol=2e-3)  # prefill == decode-step features
    torch.testing.assert_close(ref["hidden"], d["hidden"][0], atol=2e-3, rtol=2e-3)


def served_forward(model, ids: list[int], aux_layers):
    """(aux (T, 3h), hidden (T, h), logits (T, V)) of one prefill of `ids` through a fresh Runner over `model`."""
    blocks = -(-len(ids) // 16)
    runner = Runner(EngineConfig(num_blocks=blocks, max_num_seqs=1, max_num_batched_tokens=len(ids)), model.cfg,
                    model=model, ops=kernels.ops("cpu"))
    runner.allocate_kv(aux_layers=aux_layers, keep_hidden=True)
    greedy = Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, position=len(ids))
    out = runner.execute(StepPlan(input_ids=ids, starts=[0], num_tokens=[len(ids)], block_tables=[list(range(blocks))],
                                  sample_rows=[0], num_decodes=0, sampling=[greedy]))
    return out.aux, out.hidden, runner.compute_logits(out.hidden)


@pytest.mark.parametrize("temperature,num_blocks", [(0.0, 0), (0.7, 0), (0.0, 5)])
def test_self_distillation_records_the_served_quantized_model(temperature, num_blocks, monkeypatch):
    """Quantized as a replica serves it, the target answers through the C++ step (continuous
    batching: prefills and decodes share steps; with 5 blocks for 4 requests, preemptions and
    recomputes): every recorded aux row and hidden state is that of a separate forward of the
    same model over the same ids, and top1 is its argmax wherever the target chooses the next
    token (-1 inside the prompt)."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=4,
                      eos_token_ids=())
    model = build_model(cfg, EngineConfig(quantization="int4"), tiny_weights(cfg, seed=1), kernels.ops("cpu"), 512)
    if not isinstance(model, CpuModel):
        pytest.skip("the C++ step does not build on this CPU")
    preempted = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: preempted.append(seq.id) or preempt(self, seq))
    recomputed = []  # the recorder's own lm head calls: answer rows that do not sample (recomputes only)
    logits_of = Runner.compute_logits
    monkeypatch.setattr(Runner, "compute_logits", lambda self, h: recomputed.append(len(h)) or logits_of(self, h))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(12, 16, (4,), generator=g) if num_blocks else torch.randint(3, 30, (5,), generator=g)
    prompts = [torch.randint(1, 96, (int(n),), generator=g).tolist() for n in lengths]
    layers = aux_layers_for(4)
    convs = self_distill(model, prompts, layers, max_tokens=10, temperature=temperature, seed=0,
                         batch_size=4 if num_blocks else 2, num_blocks=num_blocks)
    assert bool(preempted) == bool(recomputed) == bool(num_blocks)
    for p, c in zip(prompts, convs):
        ids, n = c["ids"].tolist(), c["n_prompt"]
        assert ids[:n] == p and len(ids) == n + 9
        aux, hidden, logits = served_forward(model, ids, layers)
        torch.testing.assert_close(c["aux"].float(), aux, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(c["hidden"].float(), hidden, atol=2e-3, rtol=2e-3)
        assert (c["top1"][: n - 1] == -1).all()
        assert c["top1"][n - 1 :].tolist() == logits[n - 1 :].argmax(-1).tolist()
        if temperature == 0.0:  # greedy: each answer token is the argmax after the one before
            assert c["top1"][n - 1 : -1].tolist() == ids[n:]
    # The head trains on the served lm head: its dequantized rows give the served logits.
    _, hidden, logits = served_forward(model, convs[0]["ids"].tolist(), layers)
    torch.testing.assert_close(hidden @ output_weight(model).T, logits, atol=5e-2, rtol=1e-2)


def test_ttt_unroll_matches_chain_drafting(data):
    """Step k of the unroll at root r = what the drafter's chain computes at depth k + 1,
    when the drafts are the tokens that follow (the paged KV path and the dense TTT mask agree)."""
    model, d = data
    head = random_head(model, draft_vocab=97)  # full vocabulary: the drafts are the sequence's own tokens
    ids, n = d["ids"][0].long(), 9
    aux = d["aux"][0].float()
    steps = list(ttt_unroll(head, ids[None], aux[None], model.cos_sin, 3))
    drafter = Drafter(head, model.cos_sin, torch.zeros(2, 8, 16, *head.kv_shape()), model.ops)
    tables = torch.arange(8, dtype=torch.int32)[None]  # blocks 0..7 in order
    st = drafter.new_state()
    st.add_features(aux[: n - 1])
    tokens = ids[:n].tolist()
    with torch.inference_mode():
        o, logp, _, _ = drafter._commit([tokens], [st], tables)  # log q: the logits log-softmaxed
        torch.testing.assert_close(logp[0], steps[0][0, n - 1].log_softmax(-1), rtol=1e-4, atol=1e-4)
        anc = torch.ones(1, 3, 3, dtype=torch.bool).tril()
        g = o[:, None]
        for k in (1, 2):  # draft the true next token x_{n-1+k} at depth k
            g, _ = drafter._step(ids[n - 1 + k].view(1, 1), g, torch.tensor([n]), k, k - 1, anc, tables)
            torch.testing.assert_close(head.logits(g[:, 0])[0], steps[k][0, n - 1], rtol=1e-4, atol=1e-4)


def test_tiny_head_loss_decreases_and_training_resumes(data, tmp_path):
    model, d = data
    cfg = HeadConfig.for_target(model.cfg, 64)
    d2t = draft_vocab(d, 64, model.cfg.vocab_size)
    assert len(d2t) == 64 and d2t.tolist() == sorted(set(d2t.tolist()))
    head = init_head(cfg, model, d2t)
    kw = dict(ttt_steps=5, lr=3e-3, batch_tokens=512, progress=False)
    first = train(head, model, d, None, epochs=1, **kw)
    n_batches = len(batches(d, 512, 0))
    assert first["step"] == n_batches and len(first["acc"]) == 5
    last = train(head, model, d, tmp_path, epochs=30, save_every=10, **kw)
    # The soft cross-entropy cannot go below the target's entropy (~12 here, summed over weighted steps).
    assert last["loss"] < 0.8 * first["loss"] and sum(last["acc"]) > 1.5 * sum(first["acc"]), (first, last)
    assert (tmp_path / STATE_FILE).exists()
    # Resuming a finished run does no more steps and keeps the weights.
    again = init_head(cfg, model, d2t, seed=1)
    assert train(again, model, d, tmp_path, epochs=30, **kw) == {}
    assert torch.equal(again.fc.weight, head.fc.weight)


def test_save_load_roundtrip_and_target_check(tmp_path):
    model = tiny_target()
    head = random_head(model, draft_vocab=32)
    save_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architecture"] == "eagle3" and cfg["aux_layers"] == [0, 2, 3]
    loaded = load_head(tmp_path / "h", model.cfg, model.embed_tokens.weight)
    for (n, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    other = tiny_target(hidden_size=24, num_heads=3, num_kv_heads=1)
    with pytest.raises(ValueError, match="does not fit target"):
        load_head(tmp_path / "h", other.cfg, other.embed_tokens.weight)
    with pytest.raises(FileNotFoundError, match="speculative.train"):
        load_head(tmp_path / "missing", model.cfg, model.embed_tokens.weight)


def test_paths_and_prompts(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGECHAT_EAGLE3_DIR", str(tmp_path))
    assert head_dir("SmolLM2-135M/Q4 x") == tmp_path / "SmolLM2-135M_Q4_x"
    assert aux_layers_for(30) == (1, 14, 26) and aux_layers_for(4) == (0, 2, 3)
    train_p, held = load_prompts("train"), load_prompts("heldout")
    assert len(train_p) >= 200 and held and not set(train_p) & set(held)
    spec = TreeSpec.chain(2)
    assert spec.lookahead == 2


def test_cached_data_is_reused_only_for_what_it_was_built_from(tmp_path):
    key = data_key("m", ["a", "b"], (1, 2, 3), 128, 0, "gguf")
    assert load_data(tmp_path, key) is None
    torch.save({"ids": [torch.tensor([1, 2])], "key": key}, tmp_path / DATA_FILE)
    assert load_data(tmp_path, key)["ids"][0].tolist() == [1, 2]
    others = (data_key("m", ["a", "b", "c"], (1, 2, 3), 128, 0, "gguf"),
              data_key("m", ["a", "b"], (1, 2, 3), 64, 0, "gguf"),
              data_key("m", ["a", "b"], (1, 2, 3), 128, 0, "none"),  # the fp32 model's data is not the served one's
              data_key("m", ["a", "b"], (1, 2, 3), 128, 0, "gguf", ("magpie", 570, 0.5)))
    for other in others:
        assert other != key and load_data(tmp_path, other) is None


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_tokenizer():
    """The tiny byte-level tokenizer with a chat template (role headers written out in bytes)."""
    tok = tiny_tokenizer()
    return Tokenizer(tok.backend, eos_token_ids=tok.eos_token_ids, eos_token=tok.eos_token, chat_template=CHATML)


def test_user_turn_opening_is_where_a_user_message_starts():
    tok = chat_tokenizer()
    conv = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"}]
    for messages in ([], conv):
        opening = user_turn_opening(tok, messages)
        full = tok.encode_chat([*messages, {"role": "user", "content": "What now?"}])
        assert full[: len(opening)] == opening and tok.decode(full[len(opening):]).startswith("What now?")
        assert tok.decode(opening).endswith("<|user|>\n")


def test_the_target_writes_user_turns_it_then_answers():
    """Magpie data: written messages are the target's own sampled text after a user turn's
    opening (seeded: the same twice), dropped when cut off or held out; build_data answers
    the seed prompts, the written first messages and the written second turns, each second
    turn with the first answer in its context."""
    model, tok = tiny_target(), chat_tokenizer()
    convs = [[]] * 6 + [[{"role": "user", "content": "abc"}, {"role": "assistant", "content": "def"}]] * 2
    written = write_user_turns(model, tok, convs, seed=3, batch_size=4)
    assert written == write_user_turns(model, tok, convs, seed=3, batch_size=4)
    kept = [w for w in written if w]
    assert kept and all(len(w) >= 8 for w in kept)
    assert write_user_turns(model, tok, convs, seed=3, batch_size=4, exclude=frozenset(kept)) == [None] * len(convs)
    assert write_user_turns(model, tok, convs, seed=3, batch_size=4, max_tokens=1) == [None] * len(convs)

    prompts = ["what is a cat?", "name two colors", "count to five", "say hello"]
    log = []
    data = build_data(model, tok, prompts, aux_layers_for(4), max_tokens=12, temperatures=(0.0,), seed=0,
                      batch_size=4, self_written=8, follow_ups=0.5, log=log.append)
    firsts = write_user_turns(model, tok, [[]] * 8, seed=7000, batch_size=4)
    texts = [tok.decode(ids[:n].tolist()) for ids, n in zip(data["ids"], data["n_prompt"])]
    seconds = [t for t in texts if t.count("<|user|>") == 2]
    assert len(texts) == len(prompts) + sum(map(bool, firsts)) + len(seconds) and seconds
    assert all(any(t == tok.apply_chat_template([{"role": "user", "content": w}]) for t in texts) for w in firsts if w)
    for t in seconds:  # the first turn is a seed prompt, then the target's answer to it, then a written turn
        first = t.split("<|assistant|>\n")[0]
        assert first in [tok.apply_chat_template([{"role": "user", "content": p}], False) for p in prompts[::2]]
    assert any("second turns" in line for line in log) and any("first user messages" in line for line in log)
