"""Train an EAGLE-3 head for a target model by self-distillation.

    python -m speculative.train [--model default] [--out DIR]

1. Data. The target answers the seed prompts (speculative/data/prompts.json,
   "train") through the engine, as a replica serves it (--quantization: by
   default what `python -m replica` picks, for the default model on CPU its
   GGUF Q4_1 blocks run as one C++ call per step, which also returns the aux
   features), DISTILL_BATCH requests at once: all greedy, every third one again
   at temperature 0.7 (seeded). An aux-feature hook on the engine records, for
   every token the Runner processes, the three feature layers, the final hidden
   state h_T and (from the last prompt token on) the served model's argmax; the
   target's output distribution over the draft vocabulary is
   softmax(h_T W_head[d2t]^T) (the served lm head, dequantized), recomputed per
   batch, which keeps the data 8x smaller than storing it. Then conversations
   the target writes itself (Magpie, Xu et al. 2024, arXiv 2406.08464): given
   only its chat template's opening of a user turn, an instruction-tuned model
   writes a user message from its own distribution of them (T=1). `--self-written`
   such first messages are answered greedy, and `--follow-ups` of the greedy
   conversations get a second user turn written the same way after the first
   answer, answered greedy with the whole conversation as context (what a chat
   replica serves: later turns over a growing context). Both are off by
   default: the head reached tau 2.9 on its own training prompts and 2.1 held
   out, but the self-written data (1.9x the tokens) left held-out tau where it
   was at the same step count (docs/perf.md). Cached as data.pt with a key of what
   it was built from (target, quantization, prompts, recipe, feature layers,
   answer length, seed); any change rebuilds it.
2. Draft vocabulary: the `--draft-vocab` most frequent tokens of the data; the
   head's final norm and lm head start from the target's rows for them.
3. Training-time test (EAGLE-3, sec. 3.2). For every position r at once, step 0
   runs the head on entry r with the target's features, step k > 0 on entry
   r + k with the head's own step-(k-1) output as its feature; step k attends to
   the step-0 entries [0, r] and its own earlier steps at r+1 .. r+k, exactly
   what drafting sees. Step k's loss is the soft cross-entropy against the
   target's distribution at position r + k on the draft vocabulary, weighted
   0.8^k, over answer positions whose target argmax is in the draft vocabulary.
   acc_k is the share of those positions where the head's argmax is the
   target's: the step's greedy acceptance rate given an accepted prefix.
4. AdamW, linear warm-up, cosine decay. train_state.pt is saved every
   --save-every steps; rerunning the command resumes (--fresh starts over).

Output: config.json + model.safetensors in --out, else $EDGECHAT_EAGLE3_DIR/<model>,
else ~/.cache/edgechat/eagle3/<model> (speculative.head.head_dir).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from replica.config import EngineConfig
from replica.model.cpu_model import CpuModel, llama_of
from replica.model.llama import LlamaModel
from replica.model.quant import QWeight
from speculative.cache import head_dir
from speculative.head import Eagle3Head, HeadConfig, save_head

PROMPTS = Path(__file__).parent / "data" / "prompts.json"
DATA_FILE, STATE_FILE = "data.pt", "train_state.pt"
# Requests the target answers at once. The default model through the C++ step on the shared
# 2-core CPU (answer tokens/s, runs alternated): 192 prompts x 64 tokens, batch 64: 201, 185;
# batch 192: 249, 272. 384 prompts x 48 tokens, batch 192: 228, 456; batch 384: 218, 316.
DISTILL_BATCH = 192


def load_prompts(split: str = "train", path: str | os.PathLike = PROMPTS) -> list[str]:
    prompts = json.loads(Path(path).read_text())
    if split not in prompts:
        raise KeyError(f"{path} has no {split!r} prompts (splits: {[k for k in prompts if k != 'about']})")
    return prompts[split]


# -- 1. self-distillation data ----------------------------------------------------------------


def output_weight(model) -> torch.Tensor:
    """(V, h) fp32: the target's lm head as it serves (a quantized head dequantized)."""
    m = llama_of(model)
    if m.lm_head is None:  # tied, unquantized
        return m.embed_tokens.weight.detach().float()
    w = m.lm_head.weight
    return (w.dequantize() if isinstance(w, QWeight) else w.detach()).float()


class FeatureRecorder:
    """The engine's aux-feature hook during self-distillation: for every token the
    target processes, per request, the aux features, the final hidden state and the
    target's argmax after it (rows in position order; a recompute after preemption
    replaces the rows from where it restarts). The argmax is recorded where the next
    token is the target's (from the last prompt token on), -1 inside the prompt: the
    rows that sample already have their logits (the runner's, on the served lm head),
    so only a recompute after preemption runs the lm head again."""

    keep_hidden = True

    def __init__(self, aux_layers):
        self.aux_layers = tuple(aux_layers)
        self.runner = None  # the engine's Runner (its lm head gives the argmax of rows that do not sample)
        self.rows: dict[str, dict[str, list[torch.Tensor]]] = {}

    def feed(self, batch, out) -> None:
        aux, hidden = out.aux.half().cpu(), out.hidden.half().cpu()
        top1 = torch.full((len(hidden),), -1, dtype=torch.int32)
        sampled, rest = [], []  # rows that sample (plan_step's rule: the sequence's last token), other answer rows
        off = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            rec = self.rows.setdefault(seq.id, {"aux": [], "hidden": [], "top1": [], "n": 0})
            if rec["n"] > seq.num_computed:  # recomputed after preemption
                rec.update({k: [torch.cat(rec[k])[: seq.num_computed]] for k in ("aux", "hidden", "top1")})
            rec["n"] = seq.num_computed + n
            first = off + max(0, seq.num_prompt_tokens - 1 - seq.num_computed)  # the first row the target answers
            last = off + n - 1
            if seq.num_computed + n == len(seq):
                sampled.append(last)
                last -= 1
            rest.extend(range(first, last + 1))
            off += n
        if sampled:
            top1[sampled] = out.logits[: len(sampled)].argmax(-1).int().cpu()
        if rest:
            rest_t = torch.tensor(rest)
            top1[rest_t] = self.runner.compute_logits(out.hidden[rest_t.to(out.hidden.device)]).argmax(-1).int().cpu()
        off = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            rec = self.rows[seq.id]
            for k, v in (("aux", aux), ("hidden", hidden), ("top1", top1)):
                rec[k].append(v[off : off + n])
            off += n

    def take(self, req_id: str) -> dict[str, torch.Tensor]:
        rec = self.rows.pop(req_id)
        return {k: torch.cat(rec[k]) for k in ("aux", "hidden", "top1")}


def _engine(model, prompts: list[list[int]], max_tokens: int, batch_size: int, seed: int, num_blocks: int = 0,
            features=None):
    """An engine over `model` answering up to batch_size of `prompts` at once (room for each whole answer)."""
    from replica.engine.llm_engine import LLMEngine

    bs = 16
    blocks_per_seq = -(-(max(map(len, prompts)) + max_tokens) // bs)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    cfg = EngineConfig(device=str(model.embed_tokens.weight.device), dtype=dtype, block_size=bs,
                       num_blocks=num_blocks or batch_size * blocks_per_seq, max_num_seqs=batch_size,
                       max_num_batched_tokens=max(2048, batch_size), graph_mode="off", overlap=False, seed=seed)
    return LLMEngine(cfg, model.cfg, model=model, ops=llama_of(model).ops, features=features)


def self_distill(model, prompts: list[list[int]], aux_layers, max_tokens: int, temperature: float, seed: int,
                 batch_size: int = DISTILL_BATCH, progress: bool = False, num_blocks: int = 0) -> list[dict]:
    """The target answers the prompts: the engine (continuous batching, its seeded
    sampler; request i has seed + i) runs it with a FeatureRecorder hooked to every
    step. Per conversation: {"ids": tokens the target processed, "n_prompt", "aux"
    (T, 3h) fp16, "hidden" (T, h) fp16, "top1" (T,) int32: the argmax after each
    token, -1 before row n_prompt - 1} -- the last sampled token is never processed;
    row T-1 holds the target's distribution for it. `model` as build_model returns
    it: a CpuModel (the C++ step, as a replica serves a quantized model on CPU) or
    a LlamaModel. num_blocks: the KV pool (default: room for every running request's
    whole answer; fewer makes the engine preempt and recompute)."""
    from tqdm import tqdm

    from wire import protocol as P

    recorder = FeatureRecorder(aux_layers)
    engine = _engine(model, prompts, max_tokens, batch_size, seed, num_blocks, features=recorder)
    recorder.runner = engine.runner
    for i, p in enumerate(prompts):  # a salt each: no request skips computing a prefix another one computed
        sp = P.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        assert engine.add(P.Generate(id=str(i), prompt_ids=p, sampling=sp, cache_salt=str(i))) is None
    answers: dict[str, list[int]] = {}
    out: dict[int, dict] = {}
    bar = tqdm(total=len(prompts), disable=not progress, desc=f"answers at T={temperature}", leave=False)
    while engine.has_work():
        for m in engine.step():
            answers.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                i = int(m.id)
                ids = prompts[i] + answers.pop(m.id)
                rec = recorder.take(m.id)
                assert len(rec["aux"]) == len(ids) - 1, "a feature row per processed token"
                out[i] = {"ids": torch.tensor(ids[:-1], dtype=torch.int32), "n_prompt": len(prompts[i]), **rec}
                bar.update(1)
    bar.close()
    return [out[i] for i in range(len(prompts))]


USER_TURN_TOKENS = 64  # a written user message longer than this is dropped (cut off mid-sentence)
_MARK = "\x00edgechat-user-turn\x00"


def user_turn_opening(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered by the chat template up to where the next user
    message's text would start (its role header written, no text yet)."""
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": _MARK}], add_generation_prompt=False)
    return tokenizer.encode(text[: text.index(_MARK)], add_special_tokens=False)


def write_user_turns(model, tokenizer, conversations: list[list[dict]], seed: int, batch_size: int = DISTILL_BATCH,
                     max_tokens: int = USER_TURN_TOKENS, exclude: frozenset[str] = frozenset()) -> list[str | None]:
    """For each conversation so far (messages; [] for a new one), the next user message as
    the target writes it at T=1 from the template's opening of a user turn (Magpie).
    None where the message did not end within max_tokens, is shorter than 8 characters,
    or is one of `exclude` (the held-out prompts are never trained on)."""
    from replica.engine.offline import generate
    from wire import protocol as P

    openings = [user_turn_opening(tokenizer, c) for c in conversations]
    engine = _engine(model, openings, max_tokens, batch_size, seed)
    eos = set(tokenizer.eos_token_ids)
    sampling = [P.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i) for i in range(len(openings))]
    out = []
    for ids in generate(engine, openings, sampling).outputs:
        text = tokenizer.decode([t for t in ids if t not in eos]).strip()
        ended = bool(ids) and ids[-1] in eos
        out.append(text if ended and len(text) >= 8 and text not in exclude else None)
    return out


def build_data(model, tokenizer, prompts: list[str], aux_layers, max_tokens: int, temperatures=(0.0, 0.7),
               sampled_every: int = 3, seed: int = 0, batch_size: int = DISTILL_BATCH, self_written: int = 0,
               follow_ups: float = 0.0, exclude: frozenset[str] = frozenset(), log=print) -> dict:
    """Answers to every prompt at temperatures[0], and to every `sampled_every`-th
    prompt at each further temperature (varied text at a fraction of the cost); then
    `self_written` first user messages the target writes, answered at temperatures[0],
    and a second user turn the target writes after the first answer of a `follow_ups`
    share of the greedy seed conversations, answered at temperatures[0]."""
    chats = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    convs = []

    def answer(part_chats, temp, part_seed, what):
        t0 = time.perf_counter()
        part = self_distill(model, part_chats, aux_layers, max_tokens, temp, part_seed, batch_size=batch_size,
                            progress=True)
        n = sum(len(c["ids"]) - c["n_prompt"] + 1 for c in part)
        log(f"answered {len(part)} {what} at temperature {temp}: {n} tokens in {time.perf_counter() - t0:.0f} s")
        convs.extend(part)
        return part

    greedy = []
    for j, temp in enumerate(temperatures):
        part = answer(chats[j - 1 :: sampled_every] if j else chats, temp, seed + 1000 * j, "prompts")
        greedy = greedy or part
    if self_written:
        t0 = time.perf_counter()
        written = [w for w in write_user_turns(model, tokenizer, [[]] * self_written, seed + 7000, batch_size,
                                               exclude=exclude) if w]
        log(f"the target wrote {len(written)} of {self_written} first user messages in {time.perf_counter() - t0:.0f} s")
        answer([tokenizer.encode_chat([{"role": "user", "content": w}]) for w in written], temperatures[0],
               seed + 8000, "self-written first messages")
    if follow_ups > 0:
        every = max(1, round(1 / follow_ups))
        firsts = [[{"role": "user", "content": p},
                   {"role": "assistant", "content": tokenizer.decode(
                       [t for t in c["ids"][c["n_prompt"]:].tolist() if t not in tokenizer.eos_token_ids]).strip()}]
                  for p, c in list(zip(prompts, greedy))[::every]]
        t0 = time.perf_counter()
        nexts = write_user_turns(model, tokenizer, firsts, seed + 9000, batch_size, exclude=exclude)
        seconds = [conv + [{"role": "user", "content": w}] for conv, w in zip(firsts, nexts) if w]
        log(f"the target wrote {len(seconds)} of {len(firsts)} second user turns in {time.perf_counter() - t0:.0f} s")
        answer([tokenizer.encode_chat(conv) for conv in seconds], temperatures[0], seed + 10000, "second turns")
    convs.sort(key=lambda c: len(c["ids"]))  # similar lengths share a training batch
    return {k: [c[k] for c in convs] for k in ("ids", "n_prompt", "aux", "hidden", "top1")}


def data_key(target: str, prompts: list[str], aux_layers, max_tokens: int, seed: int, quantization: str,
             recipe: tuple = ()) -> str:
    """What a cached data.pt was built from: reused only when all of it is unchanged."""
    doc = json.dumps([target, prompts, list(aux_layers), max_tokens, seed, quantization, *recipe])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def load_data(folder: Path, key: str) -> dict | None:
    """The cached self-distillation data in `folder` if it was built for `key`, else None."""
    path = folder / DATA_FILE
    if not path.exists():
        return None
    data = torch.load(path, weights_only=True)
    return data if data.get("key") == key else None


def draft_vocab(data: dict, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of the answers (then of the prompts),
    sorted by id: the head's d2t."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, n in zip(data["ids"], data["n_prompt"]):
        counts += torch.bincount(ids[n:].long(), minlength=vocab_size)  # answers
        counts += 1e-3 * torch.bincount(ids[:n].long(), minlength=vocab_size)  # prompts break ties
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


# -- 3. training-time test --------------------------------------------------------------------


@dataclass
class Batch:
    ids: torch.Tensor  # (B, T) int64, 0-padded
    aux: torch.Tensor  # (B, T, 3h): target features at each position
    target_p: torch.Tensor  # (B, T, Vd): target distribution of the next token, on the draft vocabulary
    mask: torch.Tensor  # (B, T) bool: positions to learn (answer, in draft vocabulary, not padding)


def make_batch(data: dict, idx: list[int], head_weight: torch.Tensor, t2d: torch.Tensor, dtype=torch.float32) -> Batch:
    """head_weight: the target's lm head rows of the draft vocabulary (Vd, h); t2d (V,) bool."""
    T = max(len(data["ids"][i]) for i in idx)
    B, h3 = len(idx), data["aux"][idx[0]].shape[1]
    ids = torch.zeros(B, T, dtype=torch.int64)
    aux = torch.zeros(B, T, h3, dtype=dtype)
    hid = torch.zeros(B, T, head_weight.shape[1], dtype=dtype)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(idx):
        n = len(data["ids"][i])
        ids[b, :n] = data["ids"][i]
        aux[b, :n] = data["aux"][i].to(dtype)
        hid[b, :n] = data["hidden"][i].to(dtype)
        # Row j is the target's distribution of token j + 1: learn it where j + 1 is in the answer.
        mask[b, data["n_prompt"][i] - 1 : n] = t2d[data["top1"][i][data["n_prompt"][i] - 1 :].long()]
    dev = head_weight.device  # the training device
    with torch.no_grad():
        target_p = torch.softmax(hid.to(dev) @ head_weight.to(dtype).T, dim=-1)
    return Batch(ids.to(dev), aux.to(dev), target_p, mask.to(dev))


def ttt_attention(scale: float):
    """attend() for the training-time test. Step 0 stores its keys and values and
    attends causally; step k > 0 attends to the step-0 entries at or before its
    root r and to the root's own entries of steps 1..k (the diagonal)."""
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def expand(x, groups):  # (B, T, Hkv, D) -> (B, T, H, D)
        return x.repeat_interleave(groups, dim=2)

    def attend(q, k, v):  # q (B, T, H, D); k, v (B, T, Hkv, D)
        B, T, H, D = q.shape
        g = H // k.shape[2]
        cache.append((expand(k, g), expand(v, g)))
        k0, v0 = cache[0]
        s = torch.einsum("bthd,bshd->bhts", q, k0) * scale  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("bthd,bthd->bht", q, kj)[..., None] * scale for kj, _ in cache[1:]]  # (B, H, T, 1)
        p = torch.softmax(torch.cat([s, *diag], dim=-1), dim=-1)
        o = torch.einsum("bhts,bshd->bthd", p[..., :T], v0)
        for j, (_, vj) in enumerate(cache[1:]):
            o = o + p[..., T + j].permute(0, 2, 1)[..., None] * vj  # (B, T, H, 1) * (B, T, H, D)
        return o

    return attend


def ttt_unroll(head: Eagle3Head, ids: torch.Tensor, aux: torch.Tensor, cos_sin: torch.Tensor, steps: int):
    """Yield each step's draft logits (B, T, Vd); row r of step k is the head's guess
    for token r + k + 1 after k drafting steps from root r (fed tokens x_{r+1..r+k})."""
    B, T = ids.shape
    feats = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], dim=1)  # entry p reads a_{p-1}
    g = head.fuse(feats)  # (B, T, h)
    attend = ttt_attention(head.cfg.head_dim**-0.5)
    pos = torch.arange(T, device=ids.device).expand(B, T)
    for k in range(steps):
        # Root r, step k: the entry of token x_{r+k} at position r+k (rows past T see padding, masked).
        g = head(F.pad(ids[:, k:], (0, k)), g, pos + k, cos_sin, attend)
        yield head.logits(g).float()


def ttt_loss(head: Eagle3Head, batch: Batch, cos_sin: torch.Tensor, steps: int, decay: float = 0.8):
    """(weighted loss, [loss_k], [acc_k]) of one training-time-test unroll."""
    total, losses, accs = 0.0, [], []
    for k, logits in enumerate(ttt_unroll(head, batch.ids, batch.aux, cos_sin, steps)):
        tp = F.pad(batch.target_p[:, k:], (0, 0, 0, k))  # step k at root r answers for row r + k
        m = F.pad(batch.mask[:, k:], (0, k))
        n = m.sum().clamp_min(1)
        loss = ((-(tp * logits.log_softmax(-1)).sum(-1)) * m).sum() / n
        total = total + decay**k * loss
        losses.append(float(loss.detach()))
        accs.append(float(((logits.argmax(-1) == tp.argmax(-1)) & m).sum() / n))
    return total, losses, accs


# -- 4. the loop ------------------------------------------------------------------------------


def batches(data: dict, max_tokens: int, seed: int) -> list[list[int]]:
    """Sequences (data is sorted by length) grouped up to max_tokens padded tokens, shuffled."""
    out, cur = [], []
    for i in range(len(data["ids"])):
        n = len(data["ids"][i])
        if cur and n * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    random.Random(seed).shuffle(out)
    return out


def lr_at(step: int, progress: float, warmup: int, peak: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from peak to peak / 10 as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def feature_scale(data: dict) -> torch.Tensor:
    """(3h,) per feature dimension: its mean |a_j| over the data relative to the
    median dimension's, at least 1 (first positions, with the most extreme
    activations, left out)."""
    total, n = 0.0, 0
    for aux in data["aux"]:
        total = total + aux[1:].float().abs().sum(0)
        n += aux.shape[0] - 1
    s = total / max(1, n)
    return (s / s.median()).clamp_min(1.0)


def init_head(cfg: HeadConfig, model: LlamaModel, d2t: torch.Tensor, seed: int = 0,
              scale: torch.Tensor | None = None) -> Eagle3Head:
    """A fresh head. With `scale` (feature_scale), fc starts out reading the target's
    few massive residual dimensions (up to hundreds of times the median) at the
    median's scale, so they do not drown the rest."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, model.embed_tokens.weight.float())
    with torch.no_grad():
        if scale is not None:
            head.fc.weight.div_(scale[None, :])
        head.d2t.copy_(d2t)
        head.lm_head.weight.copy_(output_weight(model)[d2t])  # start from the target's own output layer
        head.norm.weight.copy_(llama_of(model).norm.weight.float())
    return head.to(model.embed_tokens.weight.device)


def train(head: Eagle3Head, model: LlamaModel, data: dict, out: Path | None, *, epochs: float, ttt_steps: int,
          lr: float, batch_tokens: int, warmup_frac: float = 0.05, save_every: int = 50, seed: int = 0,
          max_minutes: float = 0.0, progress: bool = True) -> dict:
    """Train in place; returns the last logged figures. With `out`, checkpoints there and resumes."""
    from tqdm import tqdm

    t2d = torch.zeros(head.cfg.target_vocab_size, dtype=torch.bool)  # on the host, as the data
    t2d[head.d2t.cpu()] = True
    head_weight = output_weight(model)[head.d2t.to(model.embed_tokens.weight.device)]
    cos_sin = model.cos_sin.float()
    per_epoch = len(batches(data, batch_tokens, seed))
    total = max(1, round(epochs * per_epoch))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    step = 0
    state_file = out / STATE_FILE if out is not None else None
    if state_file is not None and state_file.exists():
        st = torch.load(state_file, weights_only=True)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
    head.train()
    t_start, logged = time.perf_counter(), {}
    bar = tqdm(total=total, initial=step, disable=not progress, dynamic_ncols=True, desc="eagle3")
    while step < total:
        epoch, i = divmod(step, per_epoch)
        idx = batches(data, batch_tokens, seed + epoch)[i]
        # Progress: of the planned steps or of the time allowed, whichever is further along,
        # so a run cut short by --time-budget still ends with its learning rate decayed.
        elapsed = (time.perf_counter() - t_start) / 60
        frac = max(step / total, elapsed / max_minutes if max_minutes else 0.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, frac, max(1, int(warmup_frac * total)), lr)
        loss, losses, accs = ttt_loss(head, make_batch(data, idx, head_weight, t2d), cos_sin, ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        logged = {"step": step, "loss": float(loss.detach()), "losses": losses, "acc": accs}
        bar.set_postfix_str(f"loss {logged['loss']:.3f} acc " + " ".join(f"{a:.2f}" for a in accs))
        bar.update(1)
        out_of_time = max_minutes and time.perf_counter() - t_start > 60 * max_minutes
        if state_file is not None and (step % save_every == 0 or step == total or out_of_time):
            tmp = state_file.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, state_file)
        if out_of_time:
            bar.write(f"stopping at step {step}/{total}: the time budget ({max_minutes:.1f} min of training) is spent")
            break
    bar.close()
    head.eval()
    return logged


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m speculative.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="target: 'default', a GGUF file, an HF folder or hub id")
    ap.add_argument("--out", help="output folder (default: $EDGECHAT_EAGLE3_DIR/<model> or "
                                  "~/.cache/edgechat/eagle3/<model>)")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--limit-prompts", type=int, default=0, help="use only the first N prompts (quick runs)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--epochs", type=float, default=8.0)
    ap.add_argument("--batch-tokens", type=int, default=256, help="padded tokens per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--time-budget", type=float, default=28.0,
                    help="minutes for the whole run, fractions allowed (e.g. 1.5): training stops early rather than "
                         "overrun it, after at least 0.1 min; the data run is not cut short, cap it with "
                         "--limit-prompts and --max-new-tokens (0: no limit)")
    ap.add_argument("--fresh", action="store_true", help="ignore cached data and checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the target answers and the head trains (default: cuda when there is one)")
    ap.add_argument("--quantization", choices=["none", "int8", "int4", "gguf"],
                    help="the target's weights as a replica serves them (default: what `python -m replica` picks "
                         "for --model on --device: a GGUF file's own blocks or int4 on CPU, none on CUDA); the head "
                         "learns the features and distributions of exactly that model")
    ap.add_argument("--distill-batch", type=int, default=DISTILL_BATCH, help="requests the target answers at once")
    # Off by default: at the same 2,780 steps they left held-out tau where the seed prompts alone
    # put it (docs/perf.md, "Conversations the target writes itself") and cost training time.
    ap.add_argument("--self-written", type=int, default=0,
                    help="first user messages the target writes itself (Magpie) and then answers (e.g. 570); "
                         "default 0: none")
    ap.add_argument("--follow-ups", type=float, default=0.0,
                    help="share of the greedy seed conversations given a second user turn the target writes "
                         "(e.g. 0.5); default 0: none")
    args = ap.parse_args(argv)

    import kernels
    from replica.__main__ import default_quantization
    from replica.model.loader import load_checkpoint
    from replica.model.runner import build_model

    t_all = time.perf_counter()
    dev = torch.device(args.device)
    quant = args.quantization or default_quantization(args.model, dev.type, 1, False)
    ck = load_checkpoint(args.model)
    # The served model: on CPU with the C++ step (one call per step, aux features included) when it builds.
    model = build_model(ck.config, EngineConfig(model=args.model, device=str(dev), quantization=quant), ck.weights,
                        kernels.ops(dev.type), ck.config.max_position_embeddings)
    print(f"target {ck.config.name} on {dev}, quantization {quant}"
          + (" (the C++ step)" if isinstance(model, CpuModel) else ""))
    out = Path(args.out) if args.out else head_dir(ck.config.name)
    out.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        for f in (DATA_FILE, STATE_FILE):
            (out / f).unlink(missing_ok=True)
    cfg = HeadConfig.for_target(ck.config, args.draft_vocab)
    prompts = load_prompts("train", args.prompts)
    prompts = prompts[: args.limit_prompts] if args.limit_prompts else prompts
    recipe = ("magpie", args.self_written, args.follow_ups)
    key = data_key(ck.config.name, prompts, cfg.aux_layers, args.max_new_tokens, args.seed, quant, recipe)
    data = load_data(out, key)
    if data is not None:
        print(f"data: {len(data['ids'])} conversations from {out / DATA_FILE}")
    else:
        for f in (DATA_FILE, STATE_FILE):  # new data: a checkpoint trained on the old one must not resume
            (out / f).unlink(missing_ok=True)
        data = build_data(model, ck.tokenizer, prompts, cfg.aux_layers, args.max_new_tokens, seed=args.seed,
                          batch_size=args.distill_batch, self_written=args.self_written, follow_ups=args.follow_ups,
                          exclude=frozenset(json.loads(Path(args.prompts).read_text()).get("heldout", [])))
        torch.save({**data, "key": key}, out / DATA_FILE)
    n_answer = sum(len(i) - n for i, n in zip(data["ids"], data["n_prompt"]))
    d2t = draft_vocab(data, cfg.draft_vocab_size, cfg.target_vocab_size)
    covered = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
    covered[d2t] = True
    hit = sum(int(covered[i[n:].long()].sum()) for i, n in zip(data["ids"], data["n_prompt"]))
    print(f"{n_answer} answer tokens; draft vocabulary of {len(d2t)} covers {hit / max(1, n_answer):.1%} of them")
    head = init_head(cfg, model, d2t, args.seed, feature_scale(data))
    print(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.1f} M parameters; aux layers {cfg.aux_layers}")
    t0 = time.perf_counter()
    left = args.time_budget - (t0 - t_all) / 60 if args.time_budget else 0.0
    last = train(head, model, data, out, epochs=args.epochs, ttt_steps=args.ttt_steps, lr=args.lr,
                 batch_tokens=args.batch_tokens, save_every=args.save_every, seed=args.seed,
                 max_minutes=max(left, 0.1) if args.time_budget else 0.0)
    save_head(head, out)
    acc = " ".join(f"{a:.2f}" for a in last.get("acc", []))
    print(f"trained in {time.perf_counter() - t0:.0f} s (whole run {time.perf_counter() - t_all:.0f} s); last step: "
          f"loss {last.get('loss', float('nan')):.3f}, acceptance per step {acc}")
    print(f"head saved to {out}")


if __name__ == "__main__":
    main()
