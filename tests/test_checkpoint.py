"""z-lab / official checkpoint format: round trip, hand-written official files, one-line errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.atomic import umask
from flashdraft.checkpoint import check_compatible, load_drafter, save_drafter
from flashdraft.config import default_target_layer_ids
from flashdraft.decoding import generate_ids
from flashdraft.errors import FlashdraftError
from helpers import hf_greedy, random_drafter, tiny_target

H, I, HEADS, KV, D, V = 64, 128, 4, 2, 16, 96


def official_config(n_layers=2, layer_ids=(1, 2), **extra) -> dict:
    """Shaped like the config.json of the published DFlash drafters (scaled down)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "block_size": 16, "bos_token_id": 1,
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": list(layer_ids)}, "dtype": "bfloat16",
        "eos_token_id": 2, "head_dim": D, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
        "intermediate_size": I, "layer_types": ["full_attention"] * n_layers, "max_position_embeddings": 512,
        "max_window_layers": n_layers, "model_type": "qwen3", "num_attention_heads": HEADS,
        "num_hidden_layers": n_layers, "num_key_value_heads": KV, "num_target_layers": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 10000, "sliding_window": None, "tie_word_embeddings": False,
        "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": V,
    }
    cfg.update(extra)
    return cfg


def official_weights(n_layers=2, n_ids=2, seed=0) -> dict[str, torch.Tensor]:
    """Every tensor name and shape of the official layout, written out by hand."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, n_ids * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for n in range(n_layers):
        p = f"layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (HEADS * D, H), p + "self_attn.k_proj.weight": (KV * D, H),
                   p + "self_attn.v_proj.weight": (KV * D, H), p + "self_attn.o_proj.weight": (H, HEADS * D),
                   p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                   p + "post_attention_layernorm.weight": (H,)}
    return {k: (torch.randn(s, generator=g) * 0.2 if len(s) > 1 else 1 + 0.1 * torch.randn(s, generator=g)).to(torch.bfloat16)
            for k, s in shapes.items()}


def write_official(path, cfg=None, weights=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg or official_config()))
    save_file(weights or official_weights(), str(path / "model.safetensors"))
    return path


def test_official_layout_loads_and_runs(tmp_path):
    path = write_official(tmp_path / "d")
    drafter = load_drafter(path)
    assert next(drafter.parameters()).dtype == torch.bfloat16  # the file's dtype is respected
    assert drafter.config.target_layer_ids == [1, 2] and drafter.config.block_size == 16
    target = tiny_target("qwen3")
    drafter = load_drafter(path, dtype="float32")
    check_compatible(drafter.config, 4, H, V, str(path))
    prompt = list(range(3, 30))
    assert generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=24).output_ids == hf_greedy(target, prompt, 24)


def test_newer_files_with_keys_inside_dflash_config(tmp_path):
    cfg = official_config()
    del cfg["block_size"], cfg["num_target_layers"], cfg["rope_theta"]
    cfg["dflash_config"] |= {"block_size": 10}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    drafter = load_drafter(write_official(tmp_path / "d", cfg))
    assert drafter.config.block_size == 10 and drafter.config.rope_theta == 10000.0


def test_round_trip_is_exact_and_official(tmp_path):
    target = tiny_target("llama")
    drafter = random_drafter(target, output_multiplier=0.5, final_logit_softcapping=30.0)
    save_drafter(drafter, tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id
    assert raw["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    assert raw["block_size"] == 8 and raw["num_target_layers"] == 4 and raw["torch_dtype"] == "float32"
    names = set(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert names == set(official_weights().keys())  # exactly the official names: no prefix, no embed/lm_head
    for f in ("config.json", "model.safetensors"):  # readable like any file the user creates, not 0600
        assert (tmp_path / "out" / f).stat().st_mode & 0o777 == 0o666 & ~umask()
    again = load_drafter(tmp_path / "out")
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert again.config == drafter.config
    prompt = list(range(3, 15))
    a = generate_ids(target, drafter, prompt, max_new_tokens=20)
    b = generate_ids(target, again, prompt, max_new_tokens=20)
    assert [c.block for c in a.cycles] == [c.block for c in b.cycles]


def test_official_file_round_trips_through_flashdraft(tmp_path):
    src = write_official(tmp_path / "src")
    save_drafter(load_drafter(src), tmp_path / "dst")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the published Qwen3-8B drafter's ids
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 2) == [1, 27]


def _bad(tmp_path, cfg=None, weights=None):
    return write_official(tmp_path / "bad", cfg, weights)


@pytest.mark.parametrize("mutate,match", [
    (lambda c, w: w.pop("layers.1.mlp.up_proj.weight"), "missing weights"),
    (lambda c, w: w.update({"lm_head.weight": torch.zeros(V, H)}), "unexpected weights"),
    (lambda c, w: w.update({"layers.0.self_attn.q_proj.weight": torch.zeros(3, H)}), "has shape"),
    (lambda c, w: w.update({"fc.weight": torch.zeros(H, 3 * H)}), "fc takes"),
    (lambda c, w: c.update({"architectures": ["LlamaForCausalLM"]}), "not a DFlash drafter"),
    (lambda c, w: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c, w: c.update({"layer_types": ["full_attention"]}), "layer_types"),
])
def test_bad_files_give_one_line_errors(tmp_path, mutate, match):
    cfg, w = official_config(), official_weights()
    mutate(cfg, w)
    with pytest.raises(FlashdraftError, match=match) as e:
        load_drafter(_bad(tmp_path, cfg, w))
    assert "\n" not in str(e.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(FlashdraftError, match="not a directory"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(FlashdraftError, match="config.json not found"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(FlashdraftError, match="not valid JSON"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps(official_config()))
    with pytest.raises(FlashdraftError, match="no \\*.safetensors"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(FlashdraftError, match="unreadable safetensors"):
        load_drafter(tmp_path / "d")


@pytest.mark.parametrize("args,match", [
    (dict(num_layers=2), "outside the target's layers"),
    (dict(hidden_size=32), "hidden_size"),
    (dict(vocab_size=50), "vocab_size"),
])
def test_drafter_target_mismatch(tmp_path, args, match):
    cfg = load_drafter(write_official(tmp_path / "d")).config
    check_kw = dict(num_layers=4, hidden_size=H, vocab_size=V) | args
    with pytest.raises(FlashdraftError, match=match):
        check_compatible(cfg, check_kw["num_layers"], check_kw["hidden_size"], check_kw["vocab_size"], "d")


def test_mask_token_outside_vocab(tmp_path):
    cfg = official_config()
    cfg["dflash_config"]["mask_token_id"] = V + 5
    drafter = load_drafter(write_official(tmp_path / "d", cfg))
    with pytest.raises(FlashdraftError, match="mask_token_id"):
        check_compatible(drafter.config, 4, H, V, "d")


def test_save_is_atomic(tmp_path, monkeypatch):
    """A failure while writing leaves the previous checkpoint intact and no partial directory."""
    target = tiny_target("llama")
    save_drafter(random_drafter(target, seed=1), tmp_path / "ck")
    before = load_file(str(tmp_path / "ck" / "model.safetensors"))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("flashdraft.checkpoint.save_file", boom)
    with pytest.raises(OSError):
        save_drafter(random_drafter(target, seed=2), tmp_path / "ck")
    after = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_input_embedding_scale_round_trips_is_applied_and_stays_lossless(tmp_path):
    """dflash_config.input_embedding_scale (DFlash 2 checkpoints) multiplies the block embeddings, as the official
    code and vLLM do; bad values are one-line errors."""
    target = tiny_target()
    plain = random_drafter(target, arch="dflash2", selector_rank=8, selector_top_k=4)
    scaled = random_drafter(target, arch="dflash2", selector_rank=8, selector_top_k=4, input_embedding_scale=3.0)
    save_drafter(scaled, tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["dflash_config"]["input_embedding_scale"] == 3.0
    loaded = load_drafter(tmp_path / "s")
    assert loaded.config.input_embedding_scale == 3.0
    prompt = list(range(3, 30))
    a = generate_ids(target, loaded, prompt, max_new_tokens=24)
    b = generate_ids(target, plain, prompt, max_new_tokens=24)
    assert a.output_ids == b.output_ids == hf_greedy(target, prompt, 24)
    assert [c.block for c in a.cycles] != [c.block for c in b.cycles]  # same weights, scaled inputs: other drafts
    for bad in (0, -1.0, "2", float("inf"), True):
        cfg["dflash_config"]["input_embedding_scale"] = bad
        (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(FlashdraftError, match="input_embedding_scale"):
            load_drafter(tmp_path / "s")
