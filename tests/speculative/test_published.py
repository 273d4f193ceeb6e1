"""EAGLE-3 heads published by SpecForge/SGLang/vLLM (speculative/published.py), for the default
model's shape (SmolLM2-135M: hidden 576, 9 heads, 3 KV heads, 30 layers, vocab 49152): one of our
heads written in the published layout loads as the same head and drafts the same tokens, on the
C++ head step and on the PyTorch one; d2t is read as offsets; each variant the head does not
compute is refused by the field's name; the engine drafts with one and answers as plain decoding
(a real replica: tests/replica/test_published_head.py)."""

import dataclasses

import pytest
import torch

import kernels
from replica.config import EngineConfig, RopeScaling
from replica.engine.llm_engine import LLMEngine
from replica.model.llama import LlamaModel
from replica.presets import PRESETS
from speculative import published
from speculative.cache import has_head
from speculative.drafting import Drafter
from speculative.head import save_head
from speculative.loading import load_head
from speculative.tree_spec import TreeSpec
from tests.replica.tiny import tiny_config, tiny_weights
from tests.speculative.published_heads import config_variant, own_head, write_published
from tests.speculative.util import random_head, tiny_target
from wire import protocol as P

TARGET = PRESETS["smollm2-135m"]
DRAFT_VOCAB = 1024
OPS = kernels.ops("cpu")
KERNELS = {"cpp": OPS, "torch": dataclasses.replace(OPS, cpu_draft=False)}


@pytest.fixture(scope="module")
def embed():
    return 0.05 * torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def draft_ids():
    """The target ids of the draft vocabulary: far from 0..1023, so offsets are not ids."""
    g = torch.Generator().manual_seed(1)
    return torch.randperm(TARGET.vocab_size - 2000, generator=g)[:DRAFT_VOCAB].sort().values + 2000


@pytest.fixture(scope="module")
def folders(tmp_path_factory, embed, draft_ids):
    """The same head in our format ("own"), published as safetensors ("published") and as
    pytorch_model.bin ("bin")."""
    root = tmp_path_factory.mktemp("heads")
    head = own_head(TARGET, embed, draft_ids)
    return {"own": save_head(head, root / "own"), "published": write_published(head, TARGET, root / "published"),
            "bin": write_published(head, TARGET, root / "bin", bin_file=True)}


def drafts(head, spec: TreeSpec, ops, cos_sin):
    """The trees `head` drafts for three prompts with fixed random target features."""
    g = torch.Generator().manual_seed(7)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [(7 * i + 3) % 40000 for i in range(45)], [(11 * i) % 977 for i in range(21)]]
    feats = [torch.randn(len(p), 3 * TARGET.hidden_size, generator=g) for p in prompts]
    d = Drafter(head, cos_sin, torch.zeros(2, 24, 16, *head.kv_shape()), ops)
    assert (d.cpp is not None) == ops.cpu_draft
    states = []
    for p, f in zip(prompts, feats):
        st = d.new_state()
        st.add_features(f[: len(p) - 1])
        states.append(st)
    tables = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    return [(t.tokens, t.parents) for t in d.propose(prompts, states, tables, spec, [0.0] * 3, [1, 2, 3])]


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("spec", [TreeSpec.chain(4), TreeSpec(depth=4, top_k=3, budget=10)])
def test_a_published_head_drafts_what_the_same_head_of_ours_drafts(folders, embed, draft_ids, spec, kernel):
    if kernel == "cpp" and not OPS.cpu_draft:
        pytest.skip("the C++ head step does not build here")
    heads = {name: load_head(folder, TARGET, embed) for name, folder in folders.items()}
    own = heads["own"].state_dict()
    for name in ("published", "bin"):
        assert heads[name].cfg == heads["own"].cfg
        assert all(torch.equal(v, own[k]) for k, v in heads[name].state_dict().items()), name
    cos_sin = LlamaModel.rope_table(TARGET, 128)
    out = {name: drafts(h, spec, KERNELS[kernel], cos_sin) for name, h in heads.items()}
    assert out["published"] == out["own"] and out["bin"] == out["own"]
    drafted = {t for tokens, _ in out["own"] for t in tokens[1:]}
    assert drafted and drafted <= set(draft_ids.tolist())


def test_d2t_is_read_as_offsets(folders, embed, draft_ids, tmp_path):
    from safetensors.torch import load_file

    stored = load_file(str(folders["published"] / "model.safetensors"))["d2t"]
    assert torch.equal(stored, draft_ids - torch.arange(DRAFT_VOCAB))  # what SpecForge writes
    assert torch.equal(load_head(folders["published"], TARGET, embed).d2t, draft_ids)
    # Every draft token shifted by the same 40000: read as ids the map would hold only 40000s.
    shifted = torch.arange(DRAFT_VOCAB) + 40000
    folder = write_published(own_head(TARGET, embed, shifted), TARGET, tmp_path / "shifted")
    assert set(load_file(str(folder / "model.safetensors"))["d2t"].tolist()) == {40000}
    head = load_head(folder, TARGET, embed)
    assert torch.equal(head.d2t, shifted)
    tokens = {t for tree, _ in drafts(head, TreeSpec.chain(4), OPS, LlamaModel.rope_table(TARGET, 128))
              for t in tree[1:]}
    assert len(tokens) > 1 and all(40000 <= t < 40000 + DRAFT_VOCAB for t in tokens)


def test_target_ids_from_offsets_and_their_checks(tmp_path):
    cfg = dataclasses.replace(published.head_config(_config(), TARGET, tmp_path), draft_vocab_size=4,
                              target_vocab_size=10)
    assert published.target_ids(torch.tensor([3, 3, 5, 6]), None, cfg, tmp_path).tolist() == [3, 4, 7, 9]
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[3, 4, 7, 9]] = True
    assert published.target_ids(torch.tensor([3, 3, 5, 6]), mask, cfg, tmp_path).tolist() == [3, 4, 7, 9]
    for offsets, t2d in [(torch.tensor([3, 3, 5, 7]), None), (torch.tensor([0, 0, 0, -1]), None),
                         (torch.tensor([3, 3, 5, 6]), mask.roll(1)), (torch.tensor([3.0, 3, 5, 6]), None)]:
        with pytest.raises(ValueError, match="d2t|t2d"):
            published.target_ids(offsets, t2d, cfg, tmp_path)
    full = dataclasses.replace(cfg, draft_vocab_size=10)  # no d2t: the whole vocabulary, in order
    assert published.target_ids(None, None, full, tmp_path).tolist() == list(range(10))
    with pytest.raises(ValueError, match="d2t is missing"):
        published.target_ids(None, None, cfg, tmp_path)


def _config(**kw):
    return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 576, "intermediate_size": 1536,
            "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "vocab_size": 49152,
            "draft_vocab_size": 32000, "rope_theta": 100000.0, "max_position_embeddings": 8192} | kw


def test_feature_layers_default_to_sglang_and_vllm_ones_and_follow_eagle_config(folders, embed, tmp_path):
    assert published.default_aux_layers(30) == (1, 14, 26)  # the inputs of layers (2, 15, 27)
    assert published.default_aux_layers(32) == (1, 15, 28)  # Llama-3.1-8B: inputs of (2, 16, 29)
    assert published.head_config(_config(), TARGET, tmp_path).aux_layers == (1, 14, 26)
    given = published.head_config(_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 10, 20]}),
                                  TARGET, tmp_path)
    assert given.aux_layers == (2, 10, 20)
    folder = config_variant(folders["published"], tmp_path / "default", {"eagle_config": None, "head_dim": None})
    assert load_head(folder, TARGET, embed).cfg.aux_layers == (1, 14, 26)


CONFIG_VARIANTS = [
    ("architectures", {"architectures": ["Eagle3Speculator"]}),
    ("num_hidden_layers", {"num_hidden_layers": 2}),
    ("norm_before_residual", {"norm_before_residual": True}),
    ("target_hidden_size", {"target_hidden_size": 2048}),
    ("hidden_size", {"hidden_size": 1024}),
    ("vocab_size", {"vocab_size": 32000}),
    ("head_dim", {"head_dim": 32}),
    ("num_key_value_heads", {"num_key_value_heads": 2}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),  # a kind no table here computes
    ("hidden_act", {"hidden_act": "gelu"}),
    ("attention_bias", {"attention_bias": True}),
    ("mlp_bias", {"mlp_bias": True}),
    ("tie_word_embeddings", {"tie_word_embeddings": True}),
    ("logit_scale", {"logit_scale": 0.5}),
    ("intermediate_size", {"intermediate_size": None}),
    ("eagle_config.use_aux_hidden_state", {"eagle_config.use_aux_hidden_state": False}),
    ("eagle_aux_hidden_state_layer_ids", {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}),
    ("eagle_config.eagle_aux_hidden_state_layer_ids", {"eagle_config.eagle_aux_hidden_state_layer_ids": [1, 14, 30]}),
    ("eagle_config.eagle_aux_hidden_state_layer_ids", {"eagle_config.eagle_aux_hidden_state_layer_ids": [14, 1, 26]}),
    ("d2t", {"draft_vocab_size": None}),  # then the whole vocabulary, which the stored d2t does not cover
]


@pytest.mark.parametrize("field,edit", CONFIG_VARIANTS, ids=[f"{f}={list(e.values())[0]}" for f, e in CONFIG_VARIANTS])
def test_a_variant_of_the_config_is_refused_by_its_field(folders, embed, tmp_path, field, edit):
    folder = config_variant(folders["published"], tmp_path / "variant", edit)
    with pytest.raises(ValueError, match=rf"config.json: {field} |: {field} "):
        load_head(folder, TARGET, embed)


TENSOR_VARIANTS = [
    ("lm_head.weight", dict(drop=("lm_head.weight",))),
    ("midlayer.self_attn.q_proj.bias", dict(tensors={"midlayer.self_attn.q_proj.bias": torch.zeros(576)})),
    ("fc.weight", dict(tensors={"fc.weight": torch.zeros(576, 576)})),
    ("d2t", dict(tensors={"d2t": torch.full((DRAFT_VOCAB,), 49152)})),
    ("d2t", dict(drop=("d2t",))),
    ("t2d", dict(tensors={"t2d": torch.ones(49152, dtype=torch.bool)})),
    ("embed_tokens.weight", dict(tensors={"embed_tokens.weight": torch.zeros(49152, 64)})),
]


@pytest.mark.parametrize("field,edit", TENSOR_VARIANTS, ids=[f for f, _ in TENSOR_VARIANTS])
def test_a_missing_unknown_or_misshapen_tensor_is_refused_by_its_name(embed, draft_ids, tmp_path, field, edit):
    folder = write_published(own_head(TARGET, embed, draft_ids), TARGET, tmp_path / "variant", **edit)
    with pytest.raises(ValueError, match=field):
        load_head(folder, TARGET, embed)


def test_a_head_with_an_embedding_of_its_own_drafts_with_it(embed, draft_ids, tmp_path):
    own_embed = torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=torch.Generator().manual_seed(5))
    folder = write_published(own_head(TARGET, embed, draft_ids), TARGET, tmp_path / "embedded",
                             tensors={"embed_tokens.weight": own_embed})
    head = load_head(folder, TARGET, embed)
    assert torch.equal(head.embed_weight, own_embed)
    for name, tensors in {"shared": {}, "copy": {"embed_tokens.weight": embed.clone()}}.items():
        folder = write_published(own_head(TARGET, embed, draft_ids), TARGET, tmp_path / name, tensors=tensors)
        assert load_head(folder, TARGET, embed).embed_weight.data_ptr() == embed.data_ptr()  # the target's


def test_a_head_with_a_rope_of_its_own_rotates_with_its_own_table(folders, embed, draft_ids, tmp_path):
    """rope_theta / rope_scaling unlike the target's (absent theta: Llama's 10000, as in
    EAGLE3-LLaMA3.1-Instruct-8B's config against its target's 500000): the head keeps them and
    its table is built from them; the target's where they are the target's (shared, None)."""
    assert load_head(folders["published"], TARGET, embed).cfg.rope_table(TARGET, 64) is None
    for edit, theta, scaling in (({"rope_theta": 10000.0}, 10000.0, None), ({"rope_theta": None}, 10000.0, None),
                                 ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, TARGET.rope_theta,
                                  RopeScaling(rope_type="linear", factor=2.0))):
        head = load_head(config_variant(folders["published"], tmp_path / str(len(list(tmp_path.iterdir()))), edit),
                         TARGET, embed)
        want = LlamaModel.rope_table(dataclasses.replace(TARGET, rope_theta=theta, rope_scaling=scaling), 64)
        got = head.cfg.rope_table(TARGET, 64)
        assert torch.equal(got, want) and not torch.equal(got, LlamaModel.rope_table(TARGET, 64)), edit
    scaled = dataclasses.replace(TARGET, rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=2048))
    folder = write_published(own_head(scaled, embed, draft_ids), scaled, tmp_path / "llama3")
    assert load_head(folder, scaled, embed).cfg.rope_table(scaled, 64) is None  # the target's llama3 table
    head = load_head(folder, TARGET, embed)  # a llama3 head over an unscaled target: its own table
    assert torch.equal(head.cfg.rope_table(TARGET, 64), LlamaModel.rope_table(scaled, 64))
    again = load_head(published.save_published(head, TARGET, tmp_path / "again"), TARGET, embed)
    assert again.cfg.rope_table(TARGET, 64) is not None and torch.equal(again.cfg.rope_table(TARGET, 64),
                                                                        head.cfg.rope_table(TARGET, 64))


def test_a_published_folder_counts_as_a_head(folders, tmp_path):
    assert has_head(folders["published"]) and has_head(folders["bin"]) and has_head(folders["own"])
    assert not has_head(tmp_path)


def test_the_engine_drafts_with_a_published_head_and_answers_as_plain_decoding(tmp_path):
    """The engine's Speculator on a published folder (tiny target, its head feature layers given in
    eagle_config): greedy output token for token the plain engine's, drafts verified."""
    cfg = tiny_config(num_layers=4)
    w = tiny_weights(cfg)
    folder = write_published(random_head(tiny_target()), cfg, tmp_path / "head")
    prompts = {"a": [(5 * i + 1) % 97 for i in range(37)], "b": [3, 1, 4, 1, 5], "c": list(range(10, 30))}
    out = {}
    for name, kw in {"plain": {}, "chain": dict(speculative="eagle3", spec_depth=3),
                     "tree": dict(speculative="eagle3", spec_depth=4, spec_top_k=3, spec_budget=10)}.items():
        eng = LLMEngine(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=40,
                                     spec_max_batch=4, spec_policy="taper", spec_head=str(folder), **kw), cfg, w)
        for k, p in prompts.items():
            assert eng.add(P.Generate(id=k, prompt_ids=p, sampling=P.SamplingParams(
                max_tokens=16, temperature=0.0, ignore_eos=True))) is None
        toks = {}
        while eng.has_work():
            for m in eng.step():
                toks.setdefault(m.id, []).extend(m.ids)
        out[name] = toks
        if name != "plain":
            assert eng.speculator.head.cfg.aux_layers == (0, 2, 3) and eng.stats.drafted > 0
    assert out["chain"] == out["plain"] and out["tree"] == out["plain"]


def test_the_engine_binds_a_heads_own_rope_and_still_answers_as_plain_decoding(tmp_path):
    """A published head with another rope_theta than its target's: the drafter rotates with the
    head's table (Speculator.bind_kv), and the answers stay the plain engine's."""
    cfg = tiny_config(num_layers=4)
    w = tiny_weights(cfg)
    folder = config_variant(write_published(random_head(tiny_target()), cfg, tmp_path / "head"), tmp_path / "own",
                            {"rope_theta": cfg.rope_theta * 3})
    out = {}
    for name, kw in {"plain": {}, "chain": dict(speculative="eagle3", spec_depth=3)}.items():
        eng = LLMEngine(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=40,
                                     spec_max_batch=4, spec_policy="taper", spec_head=str(folder), **kw), cfg, w)
        assert eng.add(P.Generate(id="a", prompt_ids=list(range(3, 40)), sampling=P.SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True))) is None
        toks = []
        while eng.has_work():
            toks += [t for m in eng.step() for t in m.ids]
        out[name] = toks
        if name != "plain":
            table = eng.speculator.drafter.cos_sin
            own = LlamaModel.rope_table(dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 3), table.shape[0])
            assert torch.equal(table, own.to(table.dtype)) and eng.stats.drafted > 0
    assert out["chain"] == out["plain"]
