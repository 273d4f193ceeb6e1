"""The quantized model on CPU as one C++ call per step (kernels/cpu_forward.py).

`CpuModel` wraps a `LlamaModel` whose linears are packed `QLinear`s and offers its
interface (`forward`, `compute_logits`, `embed_tokens`, `cos_sin`), so the Runner
runs every step (decode rows, prefill chunks, draft trees, EAGLE-3 features)
through it unchanged: on CPU this is where CUDA would replay a graph. The wrapped
model stays the reference and keeps the weights; the C++ `Decoder` reads the same
packed tensors (gate/up repacked with its rows interleaved). Its KV pool is fp16 by
default (the Runner allocates it in `kernels.Ops.cpu_step_kv`); fp32 and int8 are served too.
Past the last layer's KV store only the rows whose logits are computed go on (`Context.logits_rows`).
Prompt rows the Runner marks narrow (`Context.narrow_rows`: `prefill_activations` "auto" for
prompts of 128+ tokens, or "int8") run their matmuls on int8 activations, with each matmul's
outlier columns (`calibrate`, `set_outliers`) in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_forward, qgemm_cpu
from replica.model.llama import Context, LlamaModel
from replica.model.quant import QLinear


def supports(model: nn.Module, dtype: torch.dtype) -> bool:
    """fp32, one rank, every linear and the head packed, shapes the step handles."""
    if not isinstance(model, LlamaModel) or dtype != torch.float32 or model.tp.world > 1:
        return False
    lins = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    c = model.cfg
    return (all(isinstance(x, QLinear) and x.packed is not None for x in lins + [model.lm_head])
            and c.hidden_size % 64 == 0 and c.q_size % 64 == 0 and c.intermediate_size % 64 == 0
            and c.head_dim in (16, 32, 64, 128))


def llama_of(model: nn.Module) -> LlamaModel:
    """The LlamaModel of a built model: itself, or the one a CpuModel (the C++ step) wraps."""
    return model.model if isinstance(model, CpuModel) else model


OUTLIERS = 8  # input columns per matmul that narrow rows keep in fp32


class CpuModel(nn.Module):
    def __init__(self, model: LlamaModel, threads: int):
        super().__init__()
        self.model = model
        c = model.cfg
        self.gate_up_order = cpu_forward.interleave_gate_up(c.intermediate_size)
        norms = [n for layer in model.layers
                 for n in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        biases = [layer.self_attn.qkv_proj.bias for layer in model.layers]
        # gate/up is packed again with its rows interleaved by 32 (the step's SwiGLU reads a supertile's pairs)
        packed = [lin.packed if order is None else qgemm_cpu.pack(lin.qs[order], lin.d[order], lin.m[order], lin.bits)
                  for lin, order in self.linears()]
        bits = [lin.bits for lin, _ in self.linears()]
        shape = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.num_layers)
        self.decoder = cpu_forward.decoder(shape, c.rms_norm_eps, model.embed_tokens.weight.detach(), model.cos_sin,
                                           model.norm.weight.detach(), [n.detach() for n in norms], biases, packed,
                                           bits, model.lm_head.packed, model.lm_head.bits, threads)

    @property
    def embed_tokens(self):
        return self.model.embed_tokens

    @property
    def cos_sin(self) -> torch.Tensor:
        return self.model.cos_sin

    @property
    def cfg(self):
        return self.model.cfg

    def forward(self, input_ids, positions, ctx: Context, kv_cache: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """LlamaModel.forward's contract: final hidden states (T, hidden), with aux_layers
        also the residual streams after those layers as a list of (T, hidden)."""
        out = self.decoder.forward(input_ids, positions, ctx.slot_mapping, ctx.num_decode_tokens,
                                   ctx.decode_block_tables, ctx.decode_seq_lens, ctx.extend_block_tables,
                                   ctx.extend_cu_seqlens_q, ctx.extend_seq_lens, ctx.tree_mask, ctx.tree_prefix_lens,
                                   kv_cache, list(aux_layers), ctx.narrow_rows, ctx.logits_rows)
        if not aux_layers:
            return out[0]
        return out[0], list(out[1].split(self.cfg.hidden_size, dim=-1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.logits(hidden)

    def linears(self) -> list[tuple[QLinear, torch.Tensor | None]]:
        """The step's matmuls in its order (qkv, o, gate/up, down per layer), each with the
        row order the step packed it in (None: as stored)."""
        return [(lin, order) for layer in self.model.layers
                for lin, order in ((layer.self_attn.qkv_proj, None), (layer.self_attn.o_proj, None),
                                   (layer.mlp.gate_up_proj, self.gate_up_order), (layer.mlp.down_proj, None))]

    def calibrate(self, run) -> list[list[int]]:
        """Each matmul's OUTLIERS input columns with the largest |x| while run() steps the
        model (every row wide; the step records each input's largest |x| per column)."""
        self.decoder.set_calibration(True)
        try:
            run()
            amax = self.decoder.column_amax()
        finally:
            self.decoder.set_calibration(False)
        return [a.topk(min(OUTLIERS, lin.in_features)).indices.sort().values.tolist()
                for a, (lin, _) in zip(amax, self.linears())]

    def set_outliers(self, cols: list[list[int]]) -> None:
        """Narrow rows keep input columns cols[i] of matmul i out of their int8 blocks, against
        those columns of its weight, exact (dequantized from the stored codes)."""
        weights = []
        for c, (lin, order) in zip(cols, self.linears()):
            c = torch.tensor(c, dtype=torch.long)
            u = qgemm_cpu.unpack_codes(lin.qs, lin.bits)[:, c].float()
            w = u * lin.d[:, c // 32] + lin.m[:, c // 32]
            weights.append((w if order is None else w[order]).T.contiguous())
        self.decoder.set_outliers(cols, weights)
