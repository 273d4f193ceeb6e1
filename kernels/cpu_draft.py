"""The EAGLE-3 draft head's step in one C++ call on CPU (issue 27).

Op by op in PyTorch a head step is ~60 dispatches plus the paged-attention
references' gathers, several times the arithmetic of a 7 M-parameter layer; the
target meanwhile runs each step as one C++ call (kernels/cpu_forward.py). `DraftStep`
holds a snapshot of the head's weights (q/k/v and gate/up stacked; the matmuls' in fp16,
half the bytes a step streams, the norms in fp32) and runs one
head step -- fc when given the target's features, the decoder layer attending to the
head's paged KV layer (a causal commit chunk, or a draft level's tree entries under
their ancestor mask), the final norm, the draft lm_head and its log-softmax -- as one
call (kernels/csrc/cpu_draft.cpp), its phases shared out by the same work-claiming pool
as the target's step (csrc/include/edgechat/pool.h). Every row's k and v are stored;
past that only the rows asked are computed: a commit keeps its entries' KV and needs
o and log q of each sequence's newest entry only (a 300-token prompt's first commit:
the attention and MLP of 1 row, not 300).

Same math as `speculative.head.Eagle3Head` with its `attend` over the paged layer
(the reference; `speculative.drafting.Drafter` runs either) with the matmul weights
rounded to fp16 (`fp16_weights` makes a head whose PyTorch math is the C++ step's):
fp32 activations, summed in other orders (tests/speculative/test_draft_step.py
compares them within float rounding); k and v are rounded to the pool's dtype when
stored. Against the fp32 head the draft logits move by about 1e-3 of their scale, so a
near-tie between two draft tokens can rank the other way; the verify decides what is
emitted either way (exactly the target's tokens). A
row's result never depends on the other rows of its step nor on the thread count.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import builds, load_cpp


def _ext():
    return load_cpp("edgechat_cpu_draft", "cpu_draft.cpp")


def available() -> bool:
    """The head step builds (once per machine) and runs here (AVX-512)."""
    return builds(_ext, "kernels.cpu_draft: the C++ head step", "drafting op by op")


def supports(head, kv: torch.Tensor) -> bool:
    """An fp32 head on CPU over its fp32 layer (the Drafter's pool is in the head's dtype; the C++
    also reads an fp16 one, as the target step does), an attention shape the C++ handles."""
    c = head.cfg
    page = kv.shape[2]
    return (head.fc.weight.dtype == torch.float32 and head.fc.weight.device.type == "cpu"
            and kv.dtype == torch.float32 and kv.is_contiguous()
            and c.head_dim in (16, 32, 64, 128) and page & (page - 1) == 0)


def _held(w: torch.Tensor) -> torch.Tensor:
    """A head weight as DraftStep holds it: a matmul's (2-d) in fp16, a norm's in fp32."""
    return w.detach().to(torch.float16 if w.dim() == 2 else torch.float32).contiguous()


def fp16_weights(head) -> None:
    """Round `head`'s parameters in place to the values DraftStep holds (its matmul weights to fp16;
    the embedding is a buffer, untouched): then the PyTorch head computes what the C++ step does."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(_held(p))


class DraftStep:
    """`forward` = one head step for every row of a draft round's commit or level."""

    def __init__(self, head, cos_sin: torch.Tensor, threads: int):
        c, m = head.cfg, head.midlayer
        a = m.self_attn
        shape = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.draft_vocab_size)
        weights = [head.fc.weight, m.input_layernorm.weight, m.hidden_norm.weight,
                   torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                   m.post_attention_layernorm.weight, torch.cat([m.mlp.gate_proj.weight, m.mlp.up_proj.weight]),
                   m.mlp.down_proj.weight, head.norm.weight, head.lm_head.weight]
        self.cfg = c
        self._head = _ext().DraftHead(list(shape), c.rms_norm_eps, head.embed_weight.float(), cos_sin.float(),
                                      [_held(w) for w in weights], threads)

    def __call__(self, ids, inp, positions, slots, tables, cu, lens, kv, out_rows, tree_mask=None, tree_n=None):
        """ids (T,) target ids; inp (T, 3h) target features (fused by fc) or (T, h) g; positions, slots (T,);
        tables (B, W) int32; cu (B + 1,) int32 rows per sequence; lens (B,) int32: without tree_mask, each
        sequence's length after this causal chunk; with it (T, E) bool, the committed entries the tree follows,
        tree_n (B,) int32 its entries so far; kv (2, blocks, page, Hkv, D); out_rows (R,): the rows whose
        outputs are wanted (every row's k and v are stored; past them only these rows are computed) ->
        (o (R, h), logp (R, draft_vocab): their outputs and log-softmaxed draft logits, log q)."""
        i64, i32 = torch.int64, torch.int32
        return self._head.forward(ids.to(i64), inp.float(), positions.to(i64), slots.to(i64), tables.to(i32),
                                  cu.to(i32), lens.to(i32), tree_mask, None if tree_n is None else tree_n.to(i32),
                                  kv, out_rows.to(i64))
