"""DFlash 2: official format, convolutions within the block, candidate paths, lossless decoding."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.checkpoint import load_drafter, save_drafter
from flashdraft.decoding import generate_ids
from flashdraft.dflash2 import grouped_conv, upgrade_to_dflash2
from flashdraft.errors import FlashdraftError
from helpers import hf_greedy, random_drafter, tiny_target
from lossless import assert_greedy_lossless
from test_checkpoint import H, V, official_config, official_weights
from test_sampling_lossless import ALPHA, CASES, chi2_pvalue, empirical, exact_distribution

K, G, R, TOPK = 2, 16, 8, 4


def official_dflash2(seed=0):
    cfg = official_config(architectures=["DFlash2DraftModel"])
    cfg["dflash_config"] |= {"conv_kernel_size": K, "conv_group_size": G, "selector_rank": R, "selector_top_k": TOPK,
                             "output_multiplier": 1.0, "final_logit_softcapping": 30.0, "block_size": 8}
    w = official_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for n in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            w[f"layers.{n}.{conv}.base_kernel"] = (torch.randn(2, K, H, generator=g) * 0.3 + 1).to(torch.bfloat16)
            w[f"layers.{n}.{conv}.kernel_projection.weight"] = (torch.randn(2 * K * H // G, H, generator=g) * 0.05).to(torch.bfloat16)
    w["candidate_selector.hidden_projection.weight"] = (torch.randn(R, H, generator=g) * 0.3).to(torch.bfloat16)
    w["candidate_selector.predecessor_codebook"] = torch.randn(V, R, generator=g).to(torch.bfloat16)
    w["candidate_selector.successor_codebook"] = torch.randn(V, R, generator=g).to(torch.bfloat16)
    return cfg, w


def write(path, cfg, w):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(path / "model.safetensors"))
    return path


def test_official_dflash2_file_loads_and_is_lossless(tmp_path):
    drafter = load_drafter(write(tmp_path / "d2", *official_dflash2()), dtype="float32")
    c = drafter.config
    assert (c.arch, c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k, c.block_size) == \
        ("dflash2", K, G, R, TOPK, 8)
    target = tiny_target("qwen3")
    for n_prompt in [1, 40]:
        prompt = list(range(3, 3 + n_prompt))
        ref = hf_greedy(target, prompt, 40)
        for bs in [2, 4, 8, 16]:
            got = generate_ids(target, drafter, prompt, block_size=bs, max_new_tokens=40).output_ids
            assert_greedy_lossless(target, prompt, got, ref)
    save_drafter(drafter, tmp_path / "again")
    raw = json.loads((tmp_path / "again" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(raw["dflash_config"])
    again = load_drafter(tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))


def test_weight_suffixed_codebooks_load_decode_and_round_trip(tmp_path):
    """The official save_pretrained spelling (`...codebook.weight`) loads like the released one and saves bare."""
    cfg, w = official_dflash2()
    suffixed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in w.items()}
    assert "candidate_selector.successor_codebook.weight" in suffixed
    a = load_drafter(write(tmp_path / "bare", cfg, w), dtype="float32")
    b = load_drafter(write(tmp_path / "suffixed", cfg, suffixed), dtype="float32")
    assert torch.equal(b.candidate_selector.predecessor_codebook, w["candidate_selector.predecessor_codebook"].float())
    assert torch.equal(b.candidate_selector.successor_codebook, w["candidate_selector.successor_codebook"].float())
    target = tiny_target("qwen3")
    prompt = list(range(3, 23))
    ra, rb = (generate_ids(target, d, prompt, block_size=8, max_new_tokens=30) for d in (a, b))
    assert rb.output_ids == ra.output_ids == hf_greedy(target, prompt, 30)
    assert [c.block for c in rb.cycles] == [c.block for c in ra.cycles]
    save_drafter(b, tmp_path / "again")
    names = set(load_file(str(tmp_path / "again" / "model.safetensors")))
    assert names == set(w)  # written with the bare names that vLLM and SGLang read
    again = load_drafter(tmp_path / "again")
    assert all(torch.equal(x, y) for x, y in zip(b.state_dict().values(), again.state_dict().values()))
    both = suffixed | {"candidate_selector.successor_codebook": w["candidate_selector.successor_codebook"].clone()}
    with pytest.raises(FlashdraftError, match="unexpected weights"):
        load_drafter(write(tmp_path / "both", cfg, both))


def test_dflash2_missing_weights_error(tmp_path):
    cfg, w = official_dflash2()
    del w["candidate_selector.successor_codebook"]
    with pytest.raises(FlashdraftError, match="missing weights"):
        load_drafter(write(tmp_path / "bad", cfg, w))


def test_upgraded_from_dflash1_drafts_identically():
    target = tiny_target("llama")
    d1 = random_drafter(target, block_size=8)
    d2 = upgrade_to_dflash2(d1, conv_group_size=16, selector_rank=8, selector_top_k=4)
    prompt = list(range(5, 25))
    # chains: the upgrade keeps each position's top-1 draft (tree runner-ups are ranked over the selector's top-k)
    a = generate_ids(target, d1, prompt, max_new_tokens=40, tree=0)
    b = generate_ids(target, d2, prompt, max_new_tokens=40, tree=0)
    assert [c.block for c in a.cycles] == [c.block for c in b.cycles]


def test_conv_stays_inside_each_block():
    torch.manual_seed(0)
    B, Hh = 4, 32
    x = torch.randn(1, 3 * B, Hh)
    base, delta = torch.randn(K, Hh), torch.randn(1, 3 * B, K, Hh // G)
    out = grouped_conv(x, base, delta, B)
    x2 = x.clone()
    x2[:, B - 1] += 10.0  # the last position of block 0 must not leak into block 1
    out2 = grouped_conv(x2, base, delta, B)
    assert torch.equal(out[:, B:], out2[:, B:])
    # block position 0 only sees itself (zero padding before the block start)
    torch.testing.assert_close(out[:, 0], (base[0] + delta[:, 0, 0].repeat_interleave(G, -1)) * x[:, 0])


@pytest.mark.parametrize("params,block_size", CASES[:1])
def test_dflash2_sampling_matches_target(params, block_size):
    target = tiny_target("llama", vocab=8, init_std=0.3, seed=3)
    d1 = random_drafter(target, init_std=0.3, seed=4)
    d2 = upgrade_to_dflash2(d1, conv_group_size=16, selector_rank=4, selector_top_k=3)
    with torch.no_grad():
        for p in d2.parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.3)  # a non-trivial selector and convolutions
    counts = empirical(target, d2, params, block_size, 1500)
    p = chi2_pvalue(counts, exact_distribution(target, params))
    assert p > ALPHA, f"DFlash 2 speculative samples do not follow the target (chi2 p={p:.2e})"
