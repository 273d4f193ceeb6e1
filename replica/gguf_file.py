"""One GGUF file: metadata, tensor index, tensors dequantized to float32 numpy.

Layout (little-endian): magic "GGUF", version (2 or 3), tensor count, kv count;
the key/value pairs; one info record per tensor (name, dims with ne0 -- the row
length -- first, ggml type, offset); padding to `general.alignment`; the data.

The container is parsed here with `struct` over a read-only mmap: GGUFReader
builds a numpy view per array element, about 2.5 s for this 49k-token
vocabulary against 0.07 s here (tests/replica/model/test_loader.py checks both agree).
Block formats (Q4_1, Q8_0, K-quants ...) are left to `gguf.quants.dequantize`.
Torch-free: the tokenizer reads its vocabulary from here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from replica.config import ModelConfig, RopeScaling

_MAGIC = b"GGUF"
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
CHATML_END = "<|im_end|>"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, rows first (GGUF lists ne0 first)
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """`metadata` (key -> value; arrays as lists) and `tensors` (name -> TensorInfo)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mm[:4] != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {self._mm[:4]!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._mm, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = self._unpack(f"<{self._unpack('<I')}Q", many=True)
            qtype, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = prod(shape) // block * type_size
            if data_start + offset + nbytes > len(self._mm):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated download?)")
            self.tensors[name] = TensorInfo(name, shape, qtype, data_start + offset, nbytes)

    # -- container parsing ----------------------------------------------------------
    def _unpack(self, fmt: str, many: bool = False):
        values = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return values if many else values[0]

    def _str(self) -> str:
        n = self._unpack("<Q")
        s = self._mm[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self._str()
        if vtype == GGUFValueType.ARRAY:
            itype, n = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
            if itype in _SCALARS:
                return list(self._unpack(f"<{n}{_SCALARS[itype]}", many=True))
            return [self._value(itype) for _ in range(n)]
        value = self._unpack("<" + _SCALARS[vtype])
        if vtype == GGUFValueType.FLOAT32:  # the shortest decimal that is this float32: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        return value

    # -- tensors ----------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The stored bytes as (rows..., bytes per row) uint8, a read-only view."""
        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        data = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], info.shape[-1] // block * type_size)

    def dequantize(self, name: str, part: tuple[int, int, int] | None = None) -> np.ndarray:
        """float32 array of the tensor's shape, writable (a copy, never a view of the file).
        part (dim, start, stop): only that slice along dim, and only its bytes are read
        (rows of a matrix; along a row, whole blocks: a cut inside a block decodes the row whole)."""
        info = self.tensors[name]
        raw = self.raw(name)
        cut = None  # a slice still to take after decoding
        if part is not None:
            dim, lo, hi = part
            block, type_size = GGML_QUANT_SIZES[info.qtype]
            if dim < len(info.shape) - 1:
                assert dim == 0, f"{name}: slicing dim {dim} of {info.shape}"
                raw = raw[lo:hi]
            elif lo % block == 0 and hi % block == 0:
                raw = raw[..., lo // block * type_size : hi // block * type_size]
            else:
                cut = (..., slice(lo, hi))
        w = dequantize(np.ascontiguousarray(raw), info.qtype)
        if cut is not None:
            w = np.ascontiguousarray(w[cut])
        w = w.astype(np.float32, copy=False)
        return w if w.flags.writeable else w.copy()  # F32 "dequantizes" to a view of the mmap

    # -- what the metadata says ---------------------------------------------------------
    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        if key not in self.metadata:
            raise ValueError(f"{self.path}: metadata key {key!r} missing")
        return self.metadata[key]

    def eos_token_ids(self) -> tuple[int, ...]:
        """tokenizer.ggml.eos_token_id, plus <|im_end|> when the chat template is ChatML."""
        ids = [int(self.require("tokenizer.ggml.eos_token_id"))]
        template = self.get("tokenizer.chat_template") or ""
        if CHATML_END in template:
            tokens = self.require("tokenizer.ggml.tokens")
            if CHATML_END in tokens:
                ids.append(tokens.index(CHATML_END))
        return tuple(dict.fromkeys(ids))

    def model_config(self) -> ModelConfig:
        arch = self.require("general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path}: GGUF architecture {arch!r} is not supported (only llama; "
                             "for Qwen2 or others pass a Hugging Face folder)")
        scaling_type = self.get(f"{arch}.rope.scaling.type", "none")
        if "rope_freqs.weight" in self.tensors or scaling_type not in ("none", "linear"):
            raise ValueError(f"{self.path}: GGUF rope scaling other than linear is not supported; "
                             "pass the Hugging Face folder instead")
        heads = int(self.require(f"{arch}.attention.head_count"))
        hidden = int(self.require(f"{arch}.embedding_length"))
        factor = self.get(f"{arch}.rope.scaling.factor")
        scaling = None
        if scaling_type == "linear" and factor and factor != 1.0:
            scaling = RopeScaling(rope_type="linear", factor=float(factor))
        bos = self.get("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            vocab_size=int(self.get(f"{arch}.vocab_size") or len(self.require("tokenizer.ggml.tokens"))),
            hidden_size=hidden,
            intermediate_size=int(self.require(f"{arch}.feed_forward_length")),
            num_layers=int(self.require(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(self.get(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(self.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=self.eos_token_ids(),
            name=Path(self.path).name.removesuffix(".gguf"),
        )
