"""Typed configs, built once at the process edge and passed down.

`ModelConfig` describes a Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral,
SmolLM2); loaders fill it from GGUF metadata or a Hugging Face config.json.
`EngineConfig` holds the engine's knobs. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

# Without a measured policy (speculative/policy.py: `bench/speculative.py
# --write-policy` on the serving device type saves one beside the head), speculation
# runs while at most this many sequences decode at once, its depth tapering
# linearly down to 1 draft token as the batch approaches it. The measured policy
# replaces this fallback; docs/perf.md has the crossover measured so far.
SPEC_MAX_BATCH = 8


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); linear is factor only."""

    rope_type: str = "llama3"  # "llama3" | "linear"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# prefill_activations "auto": prompts this long or longer prefill on int8 activations. A 256-token
# prompt's prefill is ~25 % shorter that way (docs/perf.md, "Prefill against the int8 peak"); a short
# chat turn's gains a few ms and keeps every row int16, and with it the answers it always had.
INT8_PROMPT_TOKENS = 128


@dataclass
class EngineConfig:
    model: str = "default"  # "default" | GGUF path | HF folder | hub id
    device: str = "cpu"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    quantization: str = "none"  # "none" | "int8" | "int4" | "gguf" (weight-only, CPU; see replica.model.quant)
    block_size: int = 16
    kv_memory_bytes: int = 0  # KV pool budget; 0 -> 1 GiB on CPU, gpu_memory_utilization on CUDA
    # The KV pool's dtype under the C++ CPU step: "auto" (float16), "float16", "float32" or "int8"
    # (a scale per token and kv head; kernels/paged.py). Elsewhere the pool is in the model's dtype.
    kv_cache_dtype: str = "auto"
    # The C++ CPU step's matmul activations for prompt tokens that sample nothing: "int16" (as every
    # other row), "int8" (twice the multiply-adds an instruction; kernels/qgemm_cpu.py, docs/perf.md), or
    # "auto": int8 for prompts of at least INT8_PROMPT_TOKENS tokens, where it shortens the first token.
    prefill_activations: str = "auto"
    # ... and for the plain decode rows of a step without drafts: "int16" (the default: greedy answers as the fp32
    # model's) or "int8" (as llama.cpp's activations for every row: 16 decodes' matmuls ~30 % shorter, the answers
    # a little further from fp32's; docs/perf.md, "Decode rows on int8 activations").
    decode_activations: str = "int16"
    gpu_memory_utilization: float = 0.85  # fraction of the GPU this replica may fill (weights + KV + graphs)
    num_blocks: int = 0  # >0 overrides the memory budget
    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 512  # per-step token budget (decodes + prefill chunks)
    prefill_only_tokens: int = 0  # the budget of a step without decodes (nobody waits on it); 0 -> the above
    max_model_len: int = 0  # 0 -> model's max_position_embeddings
    random_weights: bool = False
    seed: int = 0
    # "auto": CUDA graphs on CUDA, the whole step in one C++ call on CPU (quantized fp32 models);
    # "off": op by op; "buffers": padded graph buffers, eager
    graph_mode: str = "auto"
    fused_decode: bool = False  # kernels.ops(fused_decode=): rotary + KV store and decode attention in fewer launches
    overlap: bool | None = None  # schedule step N+1 while step N runs; None -> on CUDA
    tp: int = 1  # tensor-parallel ranks (one process per device)
    cpu_threads: int = 0  # threads of the engine's math on CPU; 0 -> every core for the C++ step, cores - 1 for torch
    load_report_interval_s: float = 0.5
    speculative: str = "off"  # "off" | "eagle3" (trained head) | "ngram" (prompt lookup) | "auto" (see engine)
    spec_head: str = ""  # EAGLE-3 head folder; "" -> speculative.head.head_dir(model name)
    spec_depth: int = 4  # draft tokens on the longest path (n-gram: tokens per lookup) at batch 1
    spec_top_k: int = 1  # EAGLE-3: children per expanded node (1: chains)
    spec_budget: int = 0  # EAGLE-3: draft tokens kept per tree (0: spec_depth, a chain)
    spec_max_batch: int = SPEC_MAX_BATCH  # taper: speculation off while more sequences decode
    spec_policy: str = "auto"  # "auto": policy.json beside the head when measured on this device; "taper"; a folder
    # EAGLE-3 chains draw their drafts from the head at the request's temperature and are verified by
    # rejection sampling: lossless, but a seeded output is no longer the plain decoder's tokens.
    spec_sample: bool = False

    def int8_prompts_from(self) -> int | None:
        """The prompt length from which a sequence's prompt rows that sample nothing run on int8
        activations (None: never)."""
        return {"auto": INT8_PROMPT_TOKENS, "int8": 0}.get(self.prefill_activations)

    def engine_threads(self) -> int:
        """Threads for the engine's math on CPU: every core unless cpu_threads says otherwise.
        The API process needs a core only briefly once per step (one frame of tokens)."""
        import os

        return self.cpu_threads or os.cpu_count() or 1

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.graph_mode not in ("auto", "off", "buffers"):
            raise ValueError(f"graph_mode must be auto, off or buffers, got {self.graph_mode!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float16", "float32", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, float16, float32 or int8, got {self.kv_cache_dtype!r}")
        if self.prefill_activations not in ("auto", "int16", "int8"):
            raise ValueError(f"prefill_activations must be auto, int16 or int8, got {self.prefill_activations!r}")
        if self.decode_activations not in ("int16", "int8"):
            raise ValueError(f"decode_activations must be int16 or int8, got {self.decode_activations!r}")
        if self.quantization not in ("none", "int8", "int4", "gguf"):
            raise ValueError(f"quantization must be none, int8, int4 or gguf, got {self.quantization!r}")
        if self.quantization != "none" and (self.device != "cpu" or self.tp > 1):
            raise ValueError("weight-only quantization runs on CPU with tp=1 (its kernels are torch's CPU ones); "
                             "use --quantization none")
        if self.speculative not in ("off", "eagle3", "ngram", "auto"):
            raise ValueError(f"speculative must be off, eagle3, ngram or auto, got {self.speculative!r}")
        if self.spec_depth < 1 or self.spec_top_k < 1 or self.spec_budget < 0 or self.spec_max_batch < 0:
            raise ValueError("spec_depth and spec_top_k must be >= 1, spec_budget and spec_max_batch >= 0")
        if self.spec_sample and (self.speculative not in ("eagle3", "auto") or self.spec_top_k != 1):
            raise ValueError("spec_sample draws chains from the EAGLE-3 head: use speculative=eagle3 and spec_top_k=1")

