"""Decoding as the official DFlash code does: per-layer causality from is_causal, and the end-of-generation blocks.

Everything here is held against tests/reference.py: the rule written as explicit loops over (query, key) positions,
a drafter forward with one query and head at a time, and the official generation loop recomputed without caches.
"""

import json
from pathlib import Path

import pytest
import torch

from flashdraft.config import config_from_dict, config_to_dict, load_config
from flashdraft.drafter import ContextCache, draft_hidden, inference_masks
from flashdraft.errors import FlashdraftError
from flashdraft.train.mask import pad_anchors, training_masks
from helpers import hf_greedy, random_drafter, tiny_target
from lossless import assert_greedy_lossless, generate_drafted as generate_ids
from reference import drafter_hidden, official_greedy, sees
from test_checkpoint import official_config


SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 3  # smaller than the block and the context, so both sides of the window bite
CAUSALITY = [True, False, None]  # is_causal present (both values) and absent
LAYOUTS = [[SLIDING, SLIDING], [SLIDING, FULL], [FULL, FULL]]


def drafter_with(target, layer_types, is_causal, dflash2=False, seed=1):
    """A random drafter with the given layers and is_causal (DFlash 2: random convolutions and selector too)."""
    extra = dict(arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4) if dflash2 else {}
    return random_drafter(target, block_size=8, seed=seed, layer_types=layer_types, sliding_window=WINDOW,
                          is_causal=is_causal, **extra)


@pytest.mark.parametrize("is_causal", CAUSALITY)
@pytest.mark.parametrize("kind", [SLIDING, FULL])
def test_inference_mask_follows_the_official_rule(kind, is_causal):
    cfg = random_drafter(tiny_target("llama"), layer_types=[kind, kind], sliding_window=WINDOW,
                         is_causal=is_causal).config
    n_ctx, B = 12, 8
    block_pos = torch.arange(n_ctx, n_ctx + B)[None]
    mask = inference_masks(cfg, block_pos, n_ctx).get(kind)  # None: no mask, everything visible
    got = torch.ones(B, n_ctx + B, dtype=torch.bool) if mask is None else mask[0, 0]
    k_pos = list(range(n_ctx + B))
    want = torch.tensor([[sees(q, k, kind, is_causal, WINDOW) for k in k_pos] for q in range(n_ctx, n_ctx + B)])
    assert torch.equal(got, want)
    if kind == SLIDING and is_causal is False:
        assert not want[0, n_ctx + WINDOW] and want[0, n_ctx + WINDOW - 1]  # the forward side of the window bites


@pytest.mark.parametrize("is_causal", CAUSALITY)
def test_training_masks_follow_the_official_rule(is_causal):
    B, n_ctx = 4, 20
    anchors, _ = pad_anchors([torch.tensor([3, 9, 15])])
    masks = training_masks([SLIDING, FULL], anchors, n_ctx, B, sliding_window=WINDOW, is_causal=is_causal)
    k_pos = list(range(n_ctx)) + [a + k for a in anchors[0].tolist() for k in range(B)]
    for kind in (SLIDING, FULL):
        for qi in range(3 * B):
            a, qp = int(anchors[0, qi // B]), int(anchors[0, qi // B]) + qi % B
            for ki, kp in enumerate(k_pos):
                layout = kp < a if ki < n_ctx else (ki - n_ctx) // B == qi // B
                want = layout and sees(qp, kp, kind, is_causal, WINDOW)
                assert bool(masks[kind][0, 0, qi, ki]) == want, (kind, qi, ki)


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("is_causal", CAUSALITY)
@pytest.mark.parametrize("layers", LAYOUTS, ids=["sliding", "mixed", "full"])
def test_drafted_block_matches_reference_attention(tiny_qwen3, layers, is_causal, dflash2):
    drafter = drafter_with(tiny_qwen3, layers, is_causal, dflash2)
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = tiny_qwen3(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in drafter.config.target_layer_ids], -1)
        start = 25
        emb = tiny_qwen3.get_input_embeddings()(torch.tensor([int(ids[0, start])] + [drafter.config.mask_token_id] * 7))
        got = draft_hidden(drafter, ContextCache(), feats[:, :start], emb[None], start)
    want = drafter_hidden(drafter, feats[0, :start], emb, start)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("is_causal,layers", [(False, [SLIDING, SLIDING]), (True, [FULL, SLIDING]),
                                              (None, [SLIDING, FULL])])
def test_blocks_equal_the_official_loop(tiny_qwen3, is_causal, layers, dflash2):
    """Verified blocks cycle for cycle, including the shortened last ones, and the output tokens."""
    drafter = drafter_with(tiny_qwen3, layers, is_causal, dflash2, seed=2)
    prompt = torch.randint(3, 90, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    for block_size, new in [(8, 23), (4, 13), (8, 1), (8, 2)]:
        res = generate_ids(tiny_qwen3, drafter, prompt, block_size=block_size, max_new_tokens=new)
        out, blocks = official_greedy(tiny_qwen3, drafter, prompt, block_size, new)
        assert res.output_ids == out == hf_greedy(tiny_qwen3, prompt, new)
        assert [c.block for c in res.cycles] == blocks, (block_size, new)


def test_last_blocks_shrink_to_the_tokens_still_owed():
    """verify_size = min(block_size, max_length - start), also at the context limit; no cycle once all are emitted."""
    target = tiny_target("llama", max_pos=64)
    drafter = random_drafter(target, block_size=8)
    for prompt_len, new in [(10, 20), (10, 33), (50, 40)]:
        prompt = list(range(3, 3 + prompt_len))
        res = generate_ids(target, drafter, prompt, block_size=8, max_new_tokens=new)
        max_length = min(prompt_len + new, 64)
        assert res.num_new_tokens == max_length - prompt_len
        start = prompt_len  # the anchor's position
        for c in res.cycles:
            assert len(c.block) == min(8, max_length - start)
            start += len(c.emitted)
        assert start + 1 == max_length  # the loop ends exactly when the last token owed is emitted


def test_non_causal_sliding_drafter_is_lossless(tiny_llama):
    drafter = drafter_with(tiny_llama, [SLIDING, SLIDING], False)
    for n_prompt in [1, 40]:
        prompt = list(range(5, 5 + n_prompt))
        ref = hf_greedy(tiny_llama, prompt, 30)
        for bs in [2, 4, 8]:
            for stages in [1, 3]:
                got = generate_ids(tiny_llama, drafter, prompt, block_size=bs, max_new_tokens=30, loop_stages=stages,
                                   loop_gate=-float("inf")).output_ids
                assert_greedy_lossless(tiny_llama, prompt, got, ref)


def test_is_causal_round_trips_and_bad_values_fail():
    for value in CAUSALITY:
        raw = official_config(**({} if value is None else {"is_causal": value}))
        cfg = config_from_dict(raw)
        assert cfg.is_causal is value
        assert ("is_causal" in config_to_dict(cfg)) == (value is not None)
        assert config_from_dict(config_to_dict(cfg)).is_causal is value
    with pytest.raises(FlashdraftError, match="is_causal must be true, false or absent"):
        config_from_dict(official_config(is_causal="no"))


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-b16", "smollm2-135m-instruct-dflash2-b8"])
def test_shipped_drafters_are_unaffected(name):
    """Both shipped drafters have only full layers and no is_causal: every layer still sees everything, no mask."""
    path = Path(__file__).parent.parent / "flashdraft" / "drafters" / name
    assert "is_causal" not in json.loads((path / "config.json").read_text())
    cfg = load_config(path)
    masks = inference_masks(cfg, torch.arange(40, 56)[None], 40)
    assert masks == {FULL: None}
    assert all(sees(q, k, FULL, cfg.is_causal, None) for q in range(40, 56) for k in range(56))


def test_cli_replays_an_official_style_dflash2_checkpoint(tmp_path, capsys):
    """The fixture scenario end to end: 2 non-causal sliding layers, convolutions, selector, `.weight` codebooks,
    replayed by `flashdraft generate ... --block-size 8 --max-new-tokens 48 --temperature 0 --dtype float32 --json`."""
    from safetensors.torch import load_file, save_file

    from flashdraft.checkpoint import save_drafter
    from flashdraft.cli import main
    from helpers import save_tiny_model_dir

    target = save_tiny_model_dir(tmp_path / "target", kind="qwen3")
    drafter = drafter_with(target, [SLIDING, SLIDING], False, dflash2=True, seed=4)
    save_drafter(drafter, tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    state = load_file(str(weights))
    save_file({(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()}, str(weights))
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["is_causal"] is False and raw["layer_types"] == [SLIDING, SLIDING]
    prompt = [5, 9, 11, 40, 3, 17, 60]
    code = main(["generate", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "--prompt-ids", ",".join(map(str, prompt)), "--block-size", "8", "--max-new-tokens", "48",
                 "--temperature", "0", "--dtype", "float32", "--json", "--no-lookup", "--tree", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rec = json.loads(out.out)
    want, blocks = official_greedy(target, drafter, prompt, 8, 48)
    assert rec["output_ids"] == want
    assert [c["block"] for c in rec["cycles"]] == blocks
    assert [len(b) for b in blocks][-4:] == [5, 4, 3, 2]  # the last blocks verify only the tokens still owed
