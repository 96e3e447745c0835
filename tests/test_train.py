"""Drafter training: masks, loss, train/inference agreement, prepare → train, resume, DDP, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import reference
import torch
from helpers import MASK_ID, VOCAB, random_drafter, tiny_target

from flashdraft import target as T
from flashdraft.checkpoint import load_drafter
from flashdraft.cli import main
from flashdraft.drafter import ContextCache, draft_block
from flashdraft.errors import FlashdraftError
from flashdraft.models import Target, load_target
from flashdraft.train.data import load_sequences, prepare, read_jsonl_prompts
from flashdraft.train.loss import (block_loss, loss_vocabulary, position_weights, remap_labels, tau_hat,
                                   weighted_ce)
from flashdraft.train.mask import eligible_anchors, pad_anchors, sample_anchors, training_mask, training_masks
from flashdraft.train.batches import step_indices
from flashdraft.train.build import pick_mask_token_id
from flashdraft.train.config import TrainConfig
from flashdraft.train.forward import drafter_hidden, micro_inputs, target_features
from flashdraft.train.mask import block_labels
from flashdraft.train.trainer import train

CHARS = [chr(c) for c in range(32, 32 + VOCAB - 5)]  # 91 printable characters
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    """Character-level tokenizer with a chat template: 4 specials + 91 chars = VOCAB - 1 = 95 tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unused>"]
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>", "<unused>"])
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama target + char tokenizer that stops on <|im_end|> (id 2)."""
    path = tmp_path_factory.mktemp("tiny_target")
    model = tiny_target("llama", seed=3)
    model.config.eos_token_id = 2
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    recs = [{"id": str(i), "turns": ["".join(CHARS[j] for j in torch.randint(33, 91, (int(n),), generator=g))]}
            for i, n in enumerate(torch.randint(4, 12, (24,), generator=g))]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


@pytest.fixture(scope="module")
def data_dir(tiny_dir, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "d"
    target = load_target(str(tiny_dir))
    prepare(target, read_jsonl_prompts(prompts_file), out, max_new_tokens=40, batch_size=8, shard_size=10,
            feature_layer_ids=[2], progress=False)
    return out


def tiny_cfg(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), block_size=4, num_layers=1, steps=6, batch_size=4, anchors=8,
                lr=3e-3, dtype="float32", save_dtype="float32", eval_sequences=2, eval_every=3, log_every=3,
                save_every=3, mask_token_id=MASK_ID)
    base.update(kw)
    return TrainConfig(**base)


# ---------------------------------------------------------------- (a) masks and anchors

def test_mask_every_pair():
    B, n_ctx = 4, 20
    anchors, valid = pad_anchors([torch.tensor([3, 9, 15]), torch.tensor([5])])
    m = training_mask(anchors, n_ctx, B)  # [2, 1, 12, 32]
    assert m.shape == (2, 1, 3 * B, n_ctx + 3 * B)
    for b in range(2):
        for q in range(3 * B):
            j = q // B
            a = int(anchors[b, j])
            for k in range(n_ctx + 3 * B):
                if k < n_ctx:
                    want = k < a  # strictly before the anchor: its own features do not exist at inference
                else:
                    want = (k - n_ctx) // B == j  # own block, both directions; never another block
                assert bool(m[b, 0, q, k]) == want, (b, q, k)
    assert valid.tolist() == [[True, True, True], [True, False, False]]


def test_sliding_mask_is_windowed_and_causal():
    anchors = torch.tensor([[6, 12]])
    masks = training_masks(["sliding_attention", "full_attention"], anchors, 16, 4, sliding_window=3)
    s, f = masks["sliding_attention"][0, 0], masks["full_attention"][0, 0]
    kpos = list(range(16)) + [6, 7, 8, 9, 12, 13, 14, 15]
    qpos = [6, 7, 8, 9, 12, 13, 14, 15]
    for qi, qp in enumerate(qpos):
        for ki, kp in enumerate(kpos):
            assert bool(s[qi, ki]) == (bool(f[qi, ki]) and 0 <= qp - kp < 3), (qi, ki)


def test_anchor_sampling():
    lm = torch.tensor([0] * 5 + [1] * 10 + [0] * 2 + [1] * 6, dtype=torch.bool)  # two supervised runs
    B = 4
    assert eligible_anchors(lm, B).tolist() == list(range(5, 12)) + list(range(17, 20))
    assert eligible_anchors(lm[:3], B).tolist() == []
    g = torch.Generator().manual_seed(0)
    draws = [sample_anchors(lm, B, 5, g) for _ in range(4)]
    for a in draws:
        assert len(a) == 5 and a.tolist() == sorted(set(a.tolist()))
        assert all(bool(lm[x:x + B].all()) and x + B <= len(lm) for x in a.tolist())
    assert len({tuple(a.tolist()) for a in draws}) > 1  # re-sampled every step
    assert len(sample_anchors(lm, B, 100, g)) == 10


# ---------------------------------------------------------------- loss

def test_loss_weights_tau_and_chunking():
    w = position_weights(16)
    assert w.shape == (15,) and torch.allclose(w[:3], torch.exp(-torch.arange(3.0) / 7))
    assert torch.allclose(position_weights(10)[1], torch.exp(torch.tensor(-1 / 5)))
    assert torch.allclose(position_weights(8)[1], torch.exp(torch.tensor(-1 / 4)))
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert tau_hat(correct) == pytest.approx(1 + (2 + 0 + 4) / 3)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    h = torch.randn(7, 3, 8, requires_grad=True)
    y = torch.randint(0, 11, (7, 3))
    w = position_weights(4)
    ref = sum(w[k] * torch.nn.functional.cross_entropy(head(h[m, k]), y[m, k]) for m in range(7) for k in range(3))
    num, cor, _ = block_loss(h, y, w, head, chunk_rows=6)  # 2 rows per checkpointed chunk
    assert torch.allclose(num, ref, atol=1e-5)
    assert torch.equal(cor, head(h).argmax(-1) == y)
    g1 = torch.autograd.grad(num, h)[0]
    g2 = torch.autograd.grad(weighted_ce(head(h), y, w), h)[0]
    assert torch.allclose(g1, g2, atol=1e-6)


# ---------------------------------------------------------------- (b) training forward == inference forward

@pytest.mark.parametrize("over", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
                                  {"arch": "dflash2", "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
                                  {"layer_types": ["sliding_attention"] * 2, "sliding_window": 3, "is_causal": False},
                                  {"layer_types": ["full_attention"] * 2, "is_causal": True},
                                  {"arch": "dflash2", "selector_rank": 8, "selector_top_k": 4,
                                   "input_embedding_scale": 2.5}],
                         ids=["full", "sliding", "dflash2", "sliding-non-causal", "full-causal", "embedding-scale"])
def test_training_forward_matches_draft_block(tiny_llama, over):
    drafter = random_drafter(tiny_llama, block_size=8, **over)  # dflash2: random convolutions must stay in-block
    B, n = 8, 40
    ids = torch.randint(0, VOCAB - 1, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = tiny_llama(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in drafter.config.target_layer_ids], -1)
        anchors = torch.tensor([[3, 11, 20, 32]])
        hidden = drafter_hidden(drafter, drafter, T.embed(tiny_llama), feats, ids, anchors, MASK_ID)
        train_logits = drafter.logits(hidden[:, :, 1:], T.lm_head(tiny_llama))[0]  # [N, B-1, V]
        for j, a in enumerate(anchors[0].tolist()):
            block = torch.tensor([int(ids[0, a])] + [MASK_ID] * (B - 1))
            ref = draft_block(drafter, ContextCache(), feats[:, :a], T.embed(tiny_llama)(block)[None], a,
                              T.lm_head(tiny_llama))
            assert torch.allclose(train_logits[j], ref, atol=1e-4, rtol=1e-4), (a, (train_logits[j] - ref).abs().max())
            naive = reference.drafter_hidden(drafter, feats[0, :a], T.embed(tiny_llama)(block), a)  # explicit loops
            naive = drafter.logits(naive[1:], T.lm_head(tiny_llama))
            assert torch.allclose(train_logits[j], naive, atol=1e-4, rtol=1e-4)
    labels = block_labels(ids, anchors, B)
    assert labels[0, 1].tolist() == ids[0, 12:19].tolist()


@pytest.mark.parametrize("layer_ids", [[0, 2], [1, 3]])  # [0, 2]: layer 3 never runs; [1, 3]: the last, normed
def test_training_features_per_sequence_equal_the_padded_batch(tiny_llama, layer_ids):
    """Online features (one causal lean pass per sequence, stopping after the last feature layer) equal the target's
    right-padded Hugging Face batch at every real position and are zero on padding."""
    from flashdraft.train.data import Sequence, right_pad
    g = torch.Generator().manual_seed(4)
    seqs = [Sequence(torch.randint(0, VOCAB - 1, (n,), generator=g), torch.ones(n, dtype=torch.bool))
            for n in (37, 9, 60)]
    raw = random_drafter(tiny_llama)
    raw.config.target_layer_ids = layer_ids
    cfg = tiny_cfg(Path("."), Path("."))
    got = micro_inputs(tiny_llama, raw, seqs, cfg, torch.device("cpu"), torch.float32)
    ids, attn = right_pad([s.input_ids for s in seqs])
    want, _ = target_features(tiny_llama, ids, attn, layer_ids, False)
    assert torch.equal(got.ids, ids) and got.feats.shape == want.shape
    for i, s in enumerate(seqs):
        n = len(s.input_ids)
        torch.testing.assert_close(got.feats[i, :n], want[i, :n], atol=1e-4, rtol=1e-4)
        assert not got.feats[i, n:].any()


def test_loop_stage_training_forward_matches_inference(tiny_llama):
    """A DLoop stage-s training block (revealed prefix + masks) equals the drafter run on that extended block."""
    drafter = random_drafter(tiny_llama, block_size=4)
    B, n, s = 4, 40, 3
    L = (s - 1) * (B - 1) + B  # 10: anchor, 6 revealed tokens, 3 masks
    ids = torch.randint(0, VOCAB - 1, (1, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = tiny_llama(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in drafter.config.target_layer_ids], -1)
        anchors = torch.tensor([[2, 14, 27]])
        hidden = drafter_hidden(drafter, drafter, T.embed(tiny_llama), feats, ids, anchors, MASK_ID, L, L - B + 1)
        train_logits = drafter.logits(hidden, T.lm_head(tiny_llama))[0]  # [N, L, V]
        for j, a in enumerate(anchors[0].tolist()):
            block = torch.cat([ids[0, a:a + L - B + 1], torch.full((B - 1,), MASK_ID)])
            ref = draft_block(drafter, ContextCache(), feats[:, :a], T.embed(tiny_llama)(block)[None], a,
                              T.lm_head(tiny_llama))  # [L-1, V] for block positions 1..L-1
            assert torch.allclose(train_logits[j, 1:], ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- prepare

def test_prepare_format_and_resume(tiny_dir, prompts_file, data_dir, tmp_path):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["feature_layer_ids"] == [2] and meta["max_new_tokens"] == 40
    assert sorted(p.name for p in data_dir.glob("shard_*")) == ["shard_00000", "shard_00001", "shard_00002"]
    seqs = load_sequences(data_dir, features=True)
    target = load_target(str(tiny_dir))
    prompts = read_jsonl_prompts(prompts_file)
    assert len(seqs) == len(prompts)
    enc = target.encode(prompts[0])
    s = seqs[0]
    assert s.input_ids[: len(enc)].tolist() == enc and not s.loss_mask[: len(enc)].any()
    resp = s.input_ids[len(enc):].tolist()
    assert s.loss_mask[len(enc):].all() and 0 < len(resp) <= 40
    assert (2 not in resp[:-1]) and (resp[-1] == 2) == s.finished
    ar = target.model.generate(torch.tensor([enc]), do_sample=False, max_new_tokens=40, eos_token_id=2, pad_token_id=0)
    assert resp == ar[0, len(enc):len(enc) + len(resp)].tolist()  # the target's own greedy answer
    with torch.no_grad():
        hs = target.model(input_ids=s.input_ids[None], output_hidden_states=True).hidden_states
    ref = hs[3][0]
    assert s.features.dtype == torch.bfloat16 and torch.allclose(s.features.float(), ref, atol=0.05, rtol=0.02)
    # resume: a finished shard is kept as is; a missing one is regenerated identically
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    shutil.rmtree(copy / "shard_00001")
    before = (copy / "shard_00000" / "tokens.safetensors").stat().st_mtime_ns
    prepare(target, prompts, copy, max_new_tokens=40, batch_size=8, shard_size=10, feature_layer_ids=[2],
            progress=False)
    assert (copy / "shard_00000" / "tokens.safetensors").stat().st_mtime_ns == before
    from safetensors.torch import load_file

    new, ref = (load_file(str(d / "shard_00001" / "tokens.safetensors")) for d in (copy, data_dir))
    assert new.keys() == ref.keys() and all(torch.equal(new[k], ref[k]) for k in ref)
    # extend: the last (partial) shard is regenerated with its new prompts, the others are kept
    more = prompts + ["abc", "defg"]
    prepare(target, more, copy, max_new_tokens=40, batch_size=8, shard_size=10, feature_layer_ids=[2], progress=False)
    assert (copy / "shard_00000" / "tokens.safetensors").stat().st_mtime_ns == before
    assert len(load_sequences(copy)) == 26
    prepare(target, prompts[:10], copy, max_new_tokens=40, batch_size=8, shard_size=10, feature_layer_ids=[2],
            progress=False)
    assert len(load_sequences(copy)) == 10
    with pytest.raises(FlashdraftError, match="different settings"):
        prepare(target, prompts, copy, max_new_tokens=41, batch_size=8, shard_size=10, progress=False)


def test_prepare_features_adds_to_an_existing_set(tiny_dir, prompts_file, data_dir, tmp_path):
    target = load_target(str(tiny_dir))
    prompts = read_jsonl_prompts(prompts_file)
    out = tmp_path / "plain"
    prepare(target, prompts, out, max_new_tokens=40, batch_size=8, shard_size=10, progress=False)
    with pytest.raises(FlashdraftError, match="no stored features"):
        load_sequences(out, features=True)
    prepare(target, prompts, out, max_new_tokens=40, batch_size=5, shard_size=10, feature_layer_ids=[2],
            progress=False)  # no regeneration: features come from the stored tokens
    got, ref = load_sequences(out, features=True), load_sequences(data_dir, features=True)
    assert [s.input_ids.tolist() for s in got] == [s.input_ids.tolist() for s in ref]
    assert all(torch.allclose(a.features.float(), b.features.float(), atol=0.05, rtol=0.02) for a, b in zip(got, ref))
    with pytest.raises(FlashdraftError, match="different settings"):  # changing stored features is not adding them
        prepare(target, prompts, out, max_new_tokens=40, shard_size=10, feature_layer_ids=[1], progress=False)


def test_prepare_stores_features_and_topk_of_its_answers(tiny_dir, prompts_file, data_dir, tmp_path):
    """prepare --features --topk stores the same answers as without them, features as a full forward gives them, and
    per response token the top-k of the distribution that produced it."""
    from safetensors.torch import load_file

    target = load_target(str(tiny_dir))
    prompts = read_jsonl_prompts(prompts_file)
    prepare(target, prompts, tmp_path / "d", max_new_tokens=40, batch_size=3, shard_size=10,
            feature_layer_ids=[2], topk=5, progress=False)
    got = load_sequences(tmp_path / "d", features=True, topk=True)
    ref = load_sequences(data_dir, features=True)
    assert [s.input_ids.tolist() for s in got] == [s.input_ids.tolist() for s in ref]
    for c, r in zip(got, ref):
        assert torch.allclose(c.features.float(), r.features.float(), atol=0.05, rtol=0.02)
        resp = c.loss_mask
        assert torch.equal(c.topk_ids[resp][:, 0].long(), c.input_ids[resp])  # greedy: the top-1 is the token
        assert not c.topk_ids[~resp].any() and (c.topk_logprobs[resp] <= 0).all()
    assert set(load_file(str(tmp_path / "d" / "shard_00000" / "topk.safetensors"))) == {"ids", "logprobs"}
    with pytest.raises(FlashdraftError, match="no stored top-k"):
        load_sequences(data_dir, topk=True)


def test_dev_split_and_parts(tiny_dir, prompts_file, tmp_path):
    from flashdraft.train.data import split_dev

    prompts = read_jsonl_prompts(prompts_file)
    train, dev = split_dev(prompts, 30.0)
    assert 0 < len(dev) < len(prompts) and sorted(train + dev) == sorted(prompts)
    assert split_dev(prompts[::-1], 30.0)[1] == dev[::-1]  # chosen by content, not position
    target = load_target(str(tiny_dir))
    out = tmp_path / "parts"
    for i in (1, 0):  # two processes filling one directory: each makes its own shards
        prepare(target, train, out, max_new_tokens=8, batch_size=4, shard_size=5, part=(i, 2), dev=dev,
                feature_layer_ids=[2], topk=3, progress=False)
        made = sorted(int(p.name[-5:]) for p in out.glob("shard_*"))
        assert made == ([1, 3] if i == 1 else list(range(len(made))))
    assert len(load_sequences(out, features=True, topk=True)) == len(train)
    assert [json.loads(x)["turns"][0] for x in (out / "dev.jsonl").read_text().splitlines()] == dev


def test_dataset_prompts_and_record_shapes(monkeypatch):
    import types

    from flashdraft.train.data import interleave, read_dataset_prompts

    rows = [{"turns": ["a", "b"]}, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
            {"instruction": "i"}, {"conversations": [{"from": "human", "value": "h"}]}]
    fake = types.SimpleNamespace(load_dataset=lambda name, config, split: rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert read_dataset_prompts("x/y") == ["a", "u", "i", "h"]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: [{"id": 1}]))
    with pytest.raises(FlashdraftError, match="no prompt found"):
        read_dataset_prompts("x/y")
    assert interleave([["a1", "a2", "a3"], ["b1"], ["c1", "c2"]]) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_pick_mask_token_id():
    tok = tiny_tokenizer()
    assert len(tok) == VOCAB - 1
    assert pick_mask_token_id(tok, VOCAB) == VOCAB - 1  # a spare embedding row
    assert pick_mask_token_id(tok, VOCAB - 1) == 3  # <unused>: special, not eos/pad, not in the chat template


# ---------------------------------------------------------------- (c) end to end through the CLI

def test_cli_prepare_train_reduces_loss(tiny_dir, prompts_file, tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "ckpt"
    assert main(["prepare", str(data), "--prompts", str(prompts_file), "--target", str(tiny_dir),
                 "--max-new-tokens", "40", "--batch-size", "8", "--shard-size", "12"]) == 0
    err = capsys.readouterr().err
    assert "24 sequences" in err and "on disk" in err
    assert main(["train", "--data", str(data), "--out", str(out), "--target", str(tiny_dir), "--num-layers", "1",
                 "--block-size", "4", "--steps", "40", "--batch-size", "4", "--anchors", "16", "--lr", "3e-3",
                 "--dtype", "float32", "--eval-sequences", "2", "--eval-every", "20", "--log-every", "20",
                 "--save-every", "20"]) == 0
    err = capsys.readouterr().err
    assert "mask id 95" in err and "τ̂" in err and "blocks/s" in err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["loss"] > 4.3 and rows[-1]["loss"] < rows[0]["loss"] - 0.4, rows
    assert all(0 <= r["eval_acc"] <= 1 and r["eval_tau"] >= 1 for r in rows)
    drafter = load_drafter(out / "step_0000040")  # a z-lab drafter the decoder can load
    assert drafter.config.block_size == 4 and drafter.config.mask_token_id == MASK_ID
    assert (out / "latest").read_text().strip() == "step_0000040"


def test_offline_training(data_dir, tiny_dir, tmp_path):
    target = load_target(str(tiny_dir))
    cfg = tiny_cfg(data_dir, tmp_path / "off", offline=True, num_layers=1, steps=3)
    with pytest.raises(FlashdraftError, match="target layers"):  # a 2-layer drafter wants layers [1, 1], stored [2]
        train(tiny_cfg(data_dir, tmp_path / "bad", offline=True, num_layers=2, steps=1), target=target)
    res = train(cfg, target=target, log=lambda *a, **k: None)
    assert res.final_step == 3 and torch.isfinite(torch.tensor(res.metrics["loss"]))


def test_sampled_softmax_is_the_full_softmax_restricted(tiny_llama):
    torch.manual_seed(0)
    drafter = random_drafter(tiny_llama, num_layers=1, block_size=4)
    head = T.lm_head(tiny_llama)
    h, labels = torch.randn(5, 3, drafter.config.hidden_size), torch.randint(0, VOCAB, (5, 3))
    frequent = torch.tensor([7, 3, 50])
    ids = loss_vocabulary(frequent, labels, 4, VOCAB, torch.Generator().manual_seed(1))
    assert torch.equal(ids, ids.unique()) and set(labels.flatten().tolist()) | {3, 7, 50} <= set(ids.tolist())
    y = remap_labels(labels, ids)
    assert torch.equal(ids[y], labels)
    full = drafter.logits(h, head)
    assert torch.allclose(drafter.logits(h, head, ids), full[..., ids], atol=1e-6)
    w = position_weights(4)
    num, correct, _ = block_loss(h, y, w, lambda x: drafter.logits(x, head, ids))
    ref = weighted_ce(full[..., ids], y, w)
    assert torch.allclose(num, ref, atol=1e-5) and torch.equal(correct, full[..., ids].argmax(-1) == y)


def test_target_init_copies_the_last_layers(tiny_dir, data_dir, tmp_path):
    from flashdraft.train.build import build_or_load_drafter

    target = load_target(str(tiny_dir))
    layers = target.model.model.layers
    d = build_or_load_drafter(tiny_cfg(data_dir, tmp_path / "o", num_layers=2, target_init=True), target)
    for i, src in enumerate(layers[-2:]):
        assert torch.equal(d.layers[i].mlp.down_proj.weight, src.mlp.down_proj.weight)
        assert torch.equal(d.layers[i].self_attn.k_proj.weight, src.self_attn.k_proj.weight)
    assert torch.equal(d.norm.weight, target.model.model.norm.weight)
    h = d.config.hidden_size
    assert torch.equal(d.fc.weight[:, -h:], torch.eye(h)) and not d.fc.weight[:, :-h].any()
    plain = build_or_load_drafter(tiny_cfg(data_dir, tmp_path / "o", num_layers=2), target)
    assert not torch.equal(plain.layers[0].mlp.down_proj.weight, layers[-2].mlp.down_proj.weight)
    assert torch.equal(plain.norm.weight, target.model.model.norm.weight)


def selector_case(m: int, b: int):
    """A random rank-3, top-3 candidate selector over 20 tokens with hidden [m, b, 8] and logits [m, b, 20]."""
    import types

    from flashdraft.dflash2 import CandidateSelector

    torch.manual_seed(0)
    sel = CandidateSelector(types.SimpleNamespace(hidden_size=8, vocab_size=20, selector_rank=3, selector_top_k=3))
    torch.nn.init.normal_(sel.hidden_projection.weight)
    return sel, torch.randn(m, b, 8), torch.randn(m, b, 20)


def test_selector_loss_scores_true_predecessor_and_skips_misses():
    from flashdraft.dflash2 import selector_loss

    sel, h, logits = selector_case(2, 3)
    top = logits.topk(3, -1).indices
    labels = top[..., 1].clone()
    labels[1, 2] = next(t for t in range(20) if t not in top[1, 2])  # not a candidate: skipped
    prev = torch.randint(0, 20, (2, 3))
    w = torch.tensor([1.0, 0.5, 0.25])
    num, found = selector_loss(sel, h, logits, labels, prev, w)
    assert found.tolist() == [[True] * 3, [True, True, False]]
    ref = 0.0
    with torch.no_grad():
        for m, t in found.nonzero().tolist():
            s = sel.pair_scores(h[m, t], prev[m, t], top[m, t], logits[m, t, top[m, t]])
            ref += float(w[t] * torch.nn.functional.cross_entropy(s[None], torch.tensor([1])))
    assert abs(float(num.detach()) - ref) < 1e-4
    num.backward()
    assert sel.hidden_projection.weight.grad.abs().sum() > 0


def test_train_dflash2_from_dflash1_starts_equal(data_dir, tiny_dir, tmp_path):
    from flashdraft.checkpoint import save_drafter
    from flashdraft.decoding import generate_ids
    from flashdraft.train.build import build_or_load_drafter

    target = load_target(str(tiny_dir))
    d1 = random_drafter(target.model, num_layers=1, block_size=4, mask_id=MASK_ID)
    save_drafter(d1, tmp_path / "d1")
    cfg = tiny_cfg(data_dir, tmp_path / "o", init_from=str(tmp_path / "d1"), arch="dflash2", selector_rank=8,
                   selector_top_k=4)
    d2 = build_or_load_drafter(cfg, target).eval()
    assert d2.config.arch == "dflash2" and d2.config.selector_rank == 8
    prompt = target.encode("abc")
    # the chain: the upgrade keeps each position's top-1 draft (trees also rank the runner-ups, which the selector's
    # softmax over its own top-k candidates scores differently)
    a, b = (generate_ids(target.model, d, prompt, max_new_tokens=30, tree=0) for d in (d1, d2))
    assert [c.block for c in a.cycles] == [c.block for c in b.cycles]  # identical drafts, cycle by cycle
    res = train(cfg, target=target, log=lambda *a, **k: None)
    assert len(res.metrics["eval_topk_recall_pos"]) == 3 and res.final_step == 6
    saved = load_drafter(tmp_path / "o" / "step_0000006")
    assert saved.config.arch == "dflash2" and saved.candidate_selector.hidden_projection.weight.abs().sum() > 0
    with pytest.raises(FlashdraftError, match="is a DFlash 2 drafter"):
        build_or_load_drafter(tiny_cfg(data_dir, tmp_path / "x", init_from=str(tmp_path / "o" / "step_0000006"),
                                       arch="dflash"), target)


def test_init_from_keeps_the_first_layers_or_grows(data_dir, tiny_dir, tmp_path):
    """--num-layers N with --init-from keeps the warm start's first N layers (its trained fc, norms and context path),
    or grows it to N with appended layers whose residual branches start at exactly zero: the grown drafter drafts
    exactly as the warm start did (so depths compare at equal compute), then trains its new layer."""
    from flashdraft.checkpoint import save_drafter
    from flashdraft.train.build import build_or_load_drafter

    target = load_target(str(tiny_dir))
    d2 = random_drafter(target.model, num_layers=2, block_size=4, mask_id=MASK_ID, arch="dflash2", selector_rank=8,
                        selector_top_k=4)
    save_drafter(d2, tmp_path / "d2")
    one = build_or_load_drafter(tiny_cfg(data_dir, tmp_path / "o", init_from=str(tmp_path / "d2"), num_layers=1), target)
    assert len(one.layers) == one.config.num_hidden_layers == len(one.config.layer_types) == 1
    ref = d2.state_dict()
    got = one.state_dict()
    assert set(got) == {k for k in ref if not k.startswith("layers.1.")}
    assert all(torch.equal(got[k], ref[k].float()) for k in got)
    every = tiny_cfg(data_dir, tmp_path / "o", init_from=str(tmp_path / "d2"), num_layers=None)
    assert len(build_or_load_drafter(every, target).layers) == 2
    res = train(tiny_cfg(data_dir, tmp_path / "o", init_from=str(tmp_path / "d2"), num_layers=1, steps=3, dev_every=0),
                target=target, log=lambda *a, **k: None)
    assert res.final_step == 3 and load_drafter(tmp_path / "o" / "step_0000003").config.num_hidden_layers == 1

    three = build_or_load_drafter(tiny_cfg(data_dir, tmp_path / "g", init_from=str(tmp_path / "d2"), num_layers=3),
                                  target).eval()
    assert len(three.layers) == three.config.num_hidden_layers == len(three.config.layer_types) == 3
    assert three.layers[2].mlp.up_proj.weight.abs().sum() > 0  # a copy of layer 1, not an empty layer
    torch.manual_seed(0)
    feats = torch.randn(1, 6, len(d2.config.target_layer_ids) * d2.config.target_hidden_size)
    emb = torch.randn(1, 4, d2.config.hidden_size)
    ctx_pos, blk_pos = torch.arange(6)[None], torch.arange(6, 10)[None]
    with torch.no_grad():
        want = d2(emb, blk_pos, d2.context_kv(feats, ctx_pos))
        have = three(emb, blk_pos, three.context_kv(feats, ctx_pos))
    assert torch.equal(want, have)
    res = train(tiny_cfg(data_dir, tmp_path / "g", init_from=str(tmp_path / "d2"), num_layers=3, steps=3, dev_every=0),
                target=target, log=lambda *a, **k: None)
    grown = load_drafter(tmp_path / "g" / "step_0000003")
    assert grown.config.num_hidden_layers == 3 and grown.layers[2].self_attn.o_proj.weight.abs().sum() > 0


def test_loop_aware_training(data_dir, tiny_dir, tmp_path):
    from flashdraft.train.batches import loop_stage

    assert {loop_stage(0, st, 3) for st in range(40)} == {2, 3} and loop_stage(0, 5, 1) == 1
    target = load_target(str(tiny_dir))
    quiet = lambda *a, **k: None  # noqa: E731
    full = train(tiny_cfg(data_dir, tmp_path / "a", loop_stages=3, block_size=3, loss_vocab=16), target=target,
                 log=quiet)
    assert full.metrics["eval_loop_tau"] >= 1 and "eval_loop_loss" in full.metrics
    part = train(tiny_cfg(data_dir, tmp_path / "b", loop_stages=3, block_size=3, loss_vocab=16, stop_after=3),
                 target=target, log=quiet)
    resumed = train(tiny_cfg(data_dir, tmp_path / "b", loop_stages=3, block_size=3, loss_vocab=16, resume=True),
                    target=target, log=quiet)
    assert part.final_step == 3
    a, b = full.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = train(tiny_cfg(data_dir, tmp_path / "c", block_size=3, loss_vocab=16), target=target, log=quiet)
    assert any(not torch.equal(a[k], v) for k, v in plain.drafter.state_dict().items())  # the stage loss counts


def test_sampled_softmax_training(data_dir, tiny_dir, tmp_path):
    target = load_target(str(tiny_dir))
    quiet = lambda *a, **k: None  # noqa: E731
    with pytest.raises(FlashdraftError, match="--kl-weight needs the full vocabulary"):
        train(tiny_cfg(data_dir, tmp_path / "kl", loss_vocab=16, kl_weight=0.5), target=target, log=quiet)
    full = train(tiny_cfg(data_dir, tmp_path / "a", loss_vocab=16), target=target, log=quiet)
    part = train(tiny_cfg(data_dir, tmp_path / "b", loss_vocab=16, stop_after=3), target=target, log=quiet)
    resumed = train(tiny_cfg(data_dir, tmp_path / "b", loss_vocab=16, resume=True), target=target, log=quiet)
    assert part.final_step == 3 and "eval_tau" in full.metrics
    assert len(full.metrics["eval_topk_recall_pos"]) == 3  # top-16 recall of a DFlash 1 drafter, for comparison
    a, b = full.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the sampled ids are a pure function of (seed, step)


# ---------------------------------------------------------------- (d) resume bit-for-bit

def test_resume_is_bit_for_bit(data_dir, tiny_dir, tmp_path):
    target = load_target(str(tiny_dir))
    quiet = lambda *a, **k: None  # noqa: E731
    full = train(tiny_cfg(data_dir, tmp_path / "a", kl_weight=0.5), target=target, log=quiet)
    part = train(tiny_cfg(data_dir, tmp_path / "b", kl_weight=0.5, stop_after=3), target=target, log=quiet)
    assert part.final_step == 3 and (tmp_path / "b" / "latest").read_text().strip() == "step_0000003"
    with pytest.raises(FlashdraftError, match="--resume"):
        train(tiny_cfg(data_dir, tmp_path / "b", kl_weight=0.5), target=target, log=quiet)
    with pytest.raises(FlashdraftError, match="lr was"):
        train(tiny_cfg(data_dir, tmp_path / "b", kl_weight=0.5, lr=1e-3, resume=True), target=target, log=quiet)
    resumed = train(tiny_cfg(data_dir, tmp_path / "b", kl_weight=0.5, resume=True), target=target, log=quiet)
    a, b = full.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(tmp_path / "a" / "step_0000006" / "train_state.pt", weights_only=False)
    sb = torch.load(tmp_path / "b" / "step_0000006" / "train_state.pt", weights_only=False)
    assert all(torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])
               for x, y in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()))


def test_keep_last_zero_and_a_dangling_latest_are_errors(data_dir, tiny_dir, tmp_path, capsys):
    """--keep-last 0 used to delete the checkpoint just written, and --resume then silently restarted at step 0."""
    assert main(["train", "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "c"), "--keep-last", "0"]) == 2
    err = capsys.readouterr().err.strip()  # checked before --data is read
    assert err.count("\n") == 0 and "--keep-last must be >= 1, got 0" in err, err
    out = tmp_path / "run"
    train(tiny_cfg(data_dir, out, steps=3, dev_every=0), target=load_target(str(tiny_dir)), log=lambda *a, **k: None)
    shutil.rmtree(out / "step_0000003")  # what --keep-last 0 did
    argv = ["train", "--data", str(data_dir), "--out", str(out), "--target", str(tiny_dir), "--num-layers", "1",
            "--block-size", "4", "--steps", "3", "--batch-size", "4", "--anchors", "8", "--lr", "3e-3", "--dtype",
            "float32", "--save-dtype", "float32", "--eval-sequences", "2", "--mask-token-id", str(MASK_ID)]
    for extra in (["--resume"], []):
        assert main(argv + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "names step_0000003, which holds no checkpoint" in err, err
    assert not list(out.glob("step_*"))  # and nothing was trained from step 0


@pytest.mark.slow  # ~15 s: a training subprocess is SIGKILLed mid-run, then resumed
def test_killed_run_resumes_bit_for_bit(data_dir, tiny_dir, tmp_path):
    import signal
    import time

    argv = ["train", "--data", str(data_dir), "--target", str(tiny_dir), "--num-layers", "1", "--block-size", "4",
            "--steps", "400", "--batch-size", "4", "--anchors", "8", "--lr", "1e-3", "--dtype", "float32",
            "--save-dtype", "float32", "--eval-sequences", "2", "--eval-every", "1000", "--log-every", "50",
            "--save-every", "5", "--keep-last", "2", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", *argv, "--out", str(killed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (killed / "step_0000010").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: only atomically written checkpoints survive
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    steps = sorted(p.name for p in killed.glob("step_*"))
    assert steps and all((killed / p / "train_state.pt").is_file() for p in steps)
    assert main([*argv, "--out", str(killed), "--resume"]) == 0
    assert main([*argv, "--out", str(tmp_path / "straight")]) == 0
    a = load_drafter(killed / "step_0000400").state_dict()
    b = load_drafter(tmp_path / "straight" / "step_0000400").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # ~10 s: a training subprocess gets SIGTERM mid-run
def test_sigterm_stops_training_with_a_checkpoint(data_dir, tiny_dir, tmp_path):
    import signal
    import time

    out = tmp_path / "term"
    argv = ["train", "--data", str(data_dir), "--target", str(tiny_dir), "--num-layers", "1", "--block-size", "4",
            "--steps", "100000", "--batch-size", "4", "--anchors", "8", "--dtype", "float32", "--save-dtype",
            "float32", "--eval-sequences", "2", "--eval-every", "100000", "--save-every", "100000", "--threads", "1",
            "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", *argv], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)  # the first progress line: training is under way
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    step = int((out / "latest").read_text().strip()[5:])
    assert 0 < step < 100000 and (out / f"step_{step:07d}" / "train_state.pt").is_file()
    assert "SIGTERM: stopping at step" in err and "Traceback" not in err
    assert main([*argv, "--resume", "--stop-after", "2"]) == 0  # and it resumes from there


def test_data_order_is_a_pure_function_of_step():
    assert step_indices(5, 10, 4, 0) == step_indices(5, 10, 4, 0)
    epoch0 = step_indices(0, 10, 5, 0) + step_indices(1, 10, 5, 0)
    assert sorted(epoch0) == list(range(10))


# ---------------------------------------------------------------- (e) DDP == one process

@pytest.mark.slow  # ~18 s: two torchrun workers import torch + transformers
def test_torchrun_ddp_matches_single_process(data_dir, tiny_dir, tmp_path):
    args = ["train", "--data", str(data_dir), "--out", "{out}", "--target", str(tiny_dir), "--num-layers", "2",
            "--block-size", "4", "--steps", "2", "--batch-size", "4", "--anchors", "8", "--lr", "1e-3",
            "--dtype", "float32", "--save-dtype", "float32", "--eval-sequences", "2", "--threads", "1",
            "--loss-vocab", "24"]  # the sampled softmax must draw the same ids on every rank
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
           "-m", "flashdraft.cli"] + [a.format(out=tmp_path / "ddp") for a in args]
    r = subprocess.run(ddp, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stderr
    assert main([a.format(out=tmp_path / "one") for a in args]) == 0
    a = load_drafter(tmp_path / "ddp" / "step_0000002").state_dict()
    b = load_drafter(tmp_path / "one" / "step_0000002").state_dict()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"DDP vs 1 process: max |Δw| = {diff:.2e}")
    assert diff < 1e-5, diff  # same data, anchors and global normalisation; only the all-reduce order differs


# ---------------------------------------------------------------- (f) bad input

@pytest.mark.parametrize("argv, msg", [
    (["prepare", "{tmp}/o"], "give prompts"),
    (["prepare", "{tmp}/o", "--prompts", "{tmp}/missing.jsonl"], "not found"),
    (["prepare", "{tmp}/o", "--prompts", "{tmp}/bad.jsonl"], "not valid JSON"),
    (["prepare", "{tmp}/o", "--prompts", "{tmp}/noturns.jsonl"], "no prompt found"),
    (["prepare", "{tmp}/o", "--prompts", "{tmp}/bad.jsonl", "--max-samples", "0"], "--max-samples"),
    (["train", "--data", "{tmp}/nodata", "--out", "{tmp}/c"], "not a prepared data directory"),
    (["train", "--data", "{tmp}", "--out", "{tmp}/c", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--data", "{tmp}", "--out", "{tmp}/c", "--batch-size", "3", "--lr", "-1"], "--lr must be > 0"),
])
def test_bad_input_is_one_line_exit_2(argv, msg, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n{"turns": [\n')
    (tmp_path / "noturns.jsonl").write_text('{"id": 1}\n')
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("flashdraft: error:") and msg in err, err


@pytest.mark.parametrize("flags, msg", [
    (["--gamma", "0"], "--gamma must be > 0"),  # the loss weights would be 0/0
    (["--gamma", "-2"], "--gamma must be > 0"),  # weights growing along the block
    (["--gamma", "nan"], "--gamma must be > 0"),
    (["--grad-clip", "0"], "--grad-clip must be > 0"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be in [0, 1]"),
    (["--min-lr-ratio", "-0.1"], "--min-lr-ratio must be in [0, 1]"),
    (["--weight-decay", "-0.01"], "--weight-decay must be a finite number >= 0"),
    (["--kl-weight", "-1"], "--kl-weight must be a finite number >= 0"),
    (["--distill-weight", "-1"], "--distill-weight must be a finite number >= 0"),
    (["--selector-weight", "inf"], "--selector-weight must be a finite number >= 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--lr", "nan"], "--lr must be > 0"),
    (["--keep-last", "-1"], "--keep-last must be >= 1"),
    (["--stop-after", "0"], "--stop-after must be >= 1"),
])
def test_train_ranges_are_checked_before_any_file_is_read(flags, msg, tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "c"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("flashdraft: error:") and msg in err, err


@pytest.mark.parametrize("flags, msg", [
    (["--dev-percent", "200"], "--dev-percent must be in [0, 100)"),
    (["--part", "2/2"], "--part must be I/N"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--topk", "-1"], "--topk must be >= 0"),
    (["--shard-size", "0"], "--batch-size and --shard-size must be >= 1"),
    (["--features", "--num-layers", "0"], "--num-layers must be >= 1"),
])
def test_prepare_ranges_are_checked_before_any_file_is_read(flags, msg, tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "o"), "--prompts", str(tmp_path / "missing.jsonl"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("flashdraft: error:") and msg in err, err


def test_prepare_refuses_a_prompt_beyond_the_targets_context(tiny_dir, tmp_path):
    target = load_target(str(tiny_dir))  # max_position_embeddings 512, one token per character
    with pytest.raises(FlashdraftError, match="prompt 1 has .* not fit the target's context of 512 tokens"):
        prepare(target, ["ab", "x" * 480], tmp_path / "p", max_new_tokens=40, batch_size=2, progress=False)
    assert not list((tmp_path / "p").glob("shard_*"))  # refused before anything was generated
    prepare(target, ["ab", "x" * 400], tmp_path / "q", max_new_tokens=40, batch_size=2, progress=False)


def test_api_errors(data_dir, tiny_dir, tmp_path):
    target = load_target(str(tiny_dir))
    with pytest.raises(FlashdraftError, match="--kl-weight needs"):
        train(tiny_cfg(data_dir, tmp_path / "x", offline=True, kl_weight=1.0), target=target)
    with pytest.raises(FlashdraftError, match="response of at least"):
        train(tiny_cfg(data_dir, tmp_path / "x", block_size=64), target=target)
    with pytest.raises(FlashdraftError, match="no prompts"):
        prepare(target, [], tmp_path / "y")
    with pytest.raises(FlashdraftError, match="outside the target's layers"):
        prepare(target, ["hi"], tmp_path / "y", feature_layer_ids=[9])
    other = Target(tiny_target("llama", vocab=50), target.tokenizer, "small")
    with pytest.raises(FlashdraftError, match="outside the target vocabulary"):
        train(tiny_cfg(data_dir, tmp_path / "z", mask_token_id=3), target=other)


# ---------------------------------------------------------------- training that spans sessions (issue: drafter at scale)

@pytest.fixture(scope="module")
def topk_dir(tiny_dir, prompts_file, tmp_path_factory) -> Path:
    """Offline data with features (layer 2), the target's top-4 per token and a dev split."""
    from flashdraft.train.data import split_dev

    out = tmp_path_factory.mktemp("topk") / "d"
    train_p, dev = split_dev(read_jsonl_prompts(prompts_file), 25.0)
    prepare(load_target(str(tiny_dir)), train_p, out, max_new_tokens=40, batch_size=8, shard_size=10,
            feature_layer_ids=[2], topk=4, dev=dev, progress=False)
    return out


def test_soft_ce_is_cross_entropy_against_the_renormalised_top_k():
    from flashdraft.train.loss import weighted_soft_ce

    torch.manual_seed(0)
    logits, target = torch.randn(3, 2, 10), torch.randn(3, 2, 10)
    lp, ids = torch.log_softmax(target, -1).topk(4, -1)
    w = torch.tensor([1.0, 0.5])
    ref = 0.0
    for m in range(3):
        for k in range(2):
            p = torch.zeros(10)
            p[ids[m, k]] = torch.softmax(lp[m, k], -1)  # top-4 of the target, renormalised
            ref += float(w[k] * -(p * torch.log_softmax(logits[m, k], -1)).sum())
    assert abs(float(weighted_soft_ce(logits, ids, lp, w)) - ref) < 1e-5


def test_selector_gold_replaces_the_weakest_candidate():
    from flashdraft.dflash2 import selector_loss

    sel, h, logits = selector_case(1, 2)
    top = logits.topk(3, -1).indices
    labels = torch.stack([top[0, 0, 2], torch.tensor(next(t for t in range(20) if t not in top[0, 1]))])[None]
    prev, w = torch.randint(0, 20, (1, 2)), torch.tensor([1.0, 0.5])
    skip, found = selector_loss(sel, h, logits, labels, prev, w)
    gold, found_g = selector_loss(sel, h, logits, labels, prev, w, insert_gold=True)
    assert found.tolist() == found_g.tolist() == [[True, False]]  # recall still reports the real candidates
    with torch.no_grad():
        c = top[0, 1].clone()
        c[2] = labels[0, 1]
        s = sel.pair_scores(h[0, 1], prev[0, 1], c, logits[0, 1, c])
        extra = float(w[1] * torch.nn.functional.cross_entropy(s[None], torch.tensor([2])))
    assert abs(float(gold.detach()) - float(skip.detach()) - extra) < 1e-4


def test_distillation_from_stored_top_k(topk_dir, tiny_dir, tmp_path):
    target = load_target(str(tiny_dir))
    quiet = lambda *a, **k: None  # noqa: E731
    with pytest.raises(FlashdraftError, match="--offline"):
        train(tiny_cfg(topk_dir, tmp_path / "x", distill_weight=1.0), target=target, log=quiet)
    base = dict(offline=True, steps=4, dev_every=0)
    hard = train(tiny_cfg(topk_dir, tmp_path / "hard", **base), target=target, log=quiet)
    soft = train(tiny_cfg(topk_dir, tmp_path / "soft", distill_weight=1.0, **base), target=target, log=quiet)
    both = train(tiny_cfg(topk_dir, tmp_path / "sv", distill_weight=1.0, loss_vocab=20, **base), target=target,
                 log=quiet)
    # the soft term is added
    assert soft.metrics["loss"] > hard.metrics["loss"] and torch.isfinite(torch.tensor(both.metrics["loss"]))
    a, b = hard.drafter.state_dict(), soft.drafter.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_dev_tau_selects_best_and_logs_cpu_hours(topk_dir, tiny_dir, tmp_path):
    from flashdraft.checkpoint import load_drafter
    from flashdraft.decoding import generate_ids

    target = load_target(str(tiny_dir))
    out = tmp_path / "dev"
    train(tiny_cfg(topk_dir, out, offline=True, steps=6, dev_every=3, dev_samples=2, dev_max_new_tokens=12),
          target=target, log=lambda *a, **k: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in rows if "dev_tau" in r]
    assert [r["step"] for r in dev] == [0, 3, 6] and 0 < dev[1]["cpu_hours"] <= dev[2]["cpu_hours"]
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["dev_tau"] == max(r["dev_tau"] for r in dev)
    # the logged τ is real speculative decoding: redo it with the saved best drafter
    prompts = [json.loads(x)["turns"][0] for x in (topk_dir / "dev.jsonl").read_text().splitlines()][:2]
    drafter = load_drafter(out / "best", dtype=torch.float32)
    lengths = [n for p in prompts for n in generate_ids(target.model, drafter, target.encode(p), max_new_tokens=12,
                                                        stop_token_ids=target.stop_token_ids()).acceptance_lengths]
    assert abs(sum(lengths) / len(lengths) - best["dev_tau"]) < 1e-9 and len(lengths) == best["dev_cycles"]


def test_resume_rewinds_metrics_and_never_replaces_a_better_best(topk_dir, tiny_dir, tmp_path):
    """A run that died after logging steps 4-6 and keeping a better OUT/best, but before checkpointing step 6."""
    target = load_target(str(tiny_dir))
    out = tmp_path / "run"
    cfg = dict(offline=True, steps=6, log_every=1, dev_every=3, dev_samples=2, dev_max_new_tokens=12, keep_last=5)
    train(tiny_cfg(topk_dir, out, **cfg), target=target, log=lambda *a, **k: None)
    shutil.rmtree(out / "step_0000006")
    (out / "latest").write_text("step_0000003\n")
    state = torch.load(out / "step_0000003" / "train_state.pt", weights_only=False)
    state["best"]["dev_tau"] = -1.0  # the checkpoint's record is older than OUT/best ...
    torch.save(state, out / "step_0000003" / "train_state.pt")
    best = json.loads((out / "best" / "best.json").read_text())
    (out / "best" / "best.json").write_text(json.dumps({**best, "dev_tau": 99.0}) + "\n")  # ... which is better
    (out / "best" / "mark").write_text("kept")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # a line torn by the crash
    train(tiny_cfg(topk_dir, out, resume=True, **cfg), target=target, log=lambda *a, **k: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
    assert [r["step"] for r in rows if "dev_tau" in r] == [0, 3, 6]
    assert (out / "best" / "mark").read_text() == "kept"  # not replaced by a drafter with a lower dev τ
    assert json.loads((out / "best" / "best.json").read_text())["dev_tau"] == 99.0


def test_dev_rows_count_response_tokens_trained_on_across_resumes(topk_dir, tiny_dir, tmp_path):
    """The τ-vs-tokens curve's x axis: dev rows carry the response tokens of every sequence trained on so far, and a
    resumed run carries the count on (a checkpoint that never counted them gives rows without it)."""
    from flashdraft.train.batches import prepare_sequences
    from flashdraft.train.build import build_or_load_drafter
    from flashdraft.train.curve import dev_points

    target = load_target(str(tiny_dir))
    out = tmp_path / "run"
    cfg = dict(offline=True, log_every=1, dev_every=2, dev_samples=1, dev_max_new_tokens=4, save_every=2)
    train(tiny_cfg(topk_dir, out, steps=2, **cfg), target=target, log=lambda *a, **k: None)
    train(tiny_cfg(topk_dir, out, steps=4, resume=True, extend=True, **cfg), target=target, log=lambda *a, **k: None)
    full = tiny_cfg(topk_dir, out, steps=4, **cfg)
    train_seqs, _ = prepare_sequences(full, build_or_load_drafter(full, target).config, VOCAB)
    per_step = [sum(int(train_seqs[i].loss_mask.sum()) for i in step_indices(k, len(train_seqs), 4, full.seed))
                for k in range(4)]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    dev = {r["step"]: r["response_tokens"] for r in rows if "dev_tau" in r}
    assert dev == {0: 0, 2: sum(per_step[:2]), 4: sum(per_step)} and per_step[0] > 0
    xs, ys, xlabel = dev_points(rows)  # the curve drawn to OUT/dev_tau.png: τ against millions of tokens
    assert xs == [dev[k] / 1e6 for k in (0, 2, 4)] and ys == [r["dev_tau"] for r in rows if "dev_tau" in r]
    assert xlabel.startswith("response tokens") and (out / "dev_tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = torch.load(out / "step_0000004" / "train_state.pt", weights_only=False)
    del state["response_tokens"]
    torch.save(state, out / "step_0000004" / "train_state.pt")
    train(tiny_cfg(topk_dir, out, steps=6, resume=True, extend=True, **cfg), target=target, log=lambda *a, **k: None)
    last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 6 and "dev_tau" in last and "response_tokens" not in last
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert dev_points(rows)[0] == [0, 2, 4, 6]  # a row without the count: the curve falls back to steps


def test_dev_prompts_interleave_every_data_directory(tiny_dir, tmp_path):
    """With several --data directories, dev τ is measured on all their dev splits, round-robin, so checkpoint
    selection weighs every training source; --dev-prompts overrides them."""
    from flashdraft.train.evaluate import dev_setup

    target = load_target(str(tiny_dir))
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]  # c has no dev split
    for d, prompts in zip(dirs, (["a0", "a1", "a2"], ["b0"], [])):
        d.mkdir()
        if prompts:
            (d / "dev.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    quiet = lambda *a, **k: None  # noqa: E731
    cfg = tiny_cfg(dirs[0], tmp_path / "run", dev_samples=3)
    cfg.data = list(map(str, dirs))
    assert dev_setup(cfg, target, True, quiet)["ids"] == [target.encode(p) for p in ("a0", "b0", "a1")]
    cfg.dev_prompts = str(dirs[1] / "dev.jsonl")
    own = dev_setup(cfg, target, True, quiet)
    assert own["ids"] == [target.encode("b0")]
    assert dev_setup(tiny_cfg(dirs[2], tmp_path / "run"), target, True, quiet) is None
    with pytest.raises(FlashdraftError, match="does not exist"):
        dev_setup(tiny_cfg(dirs[2], tmp_path / "run", dev_prompts=str(tmp_path / "nope.jsonl")), target, True, quiet)


def test_resume_extend_accepts_grown_data_and_more_steps(tiny_dir, prompts_file, tmp_path):
    target = load_target(str(tiny_dir))
    quiet = lambda *a, **k: None  # noqa: E731
    prompts = read_jsonl_prompts(prompts_file)
    data = tmp_path / "grow"
    prepare(target, prompts[:12], data, max_new_tokens=40, batch_size=8, shard_size=6, progress=False)
    train(tiny_cfg(data, tmp_path / "run", steps=3, dev_every=0), target=target, log=quiet)
    prepare(target, prompts, data, max_new_tokens=40, batch_size=8, shard_size=6, progress=False)  # more data
    with pytest.raises(FlashdraftError, match="same data"):
        train(tiny_cfg(data, tmp_path / "run", steps=3, resume=True, dev_every=0), target=target, log=quiet)
    with pytest.raises(FlashdraftError, match="steps was"):
        train(tiny_cfg(data, tmp_path / "run", steps=5, resume=True, dev_every=0), target=target, log=quiet)
    res = train(tiny_cfg(data, tmp_path / "run", steps=5, resume=True, extend=True, dev_every=0), target=target,
                log=quiet)
    assert res.final_step == 5 and (tmp_path / "run" / "latest").read_text().strip() == "step_0000005"
    st = torch.load(tmp_path / "run" / "step_0000005" / "train_state.pt", weights_only=False)
    assert st["cpu_s"] > 0 and st["num_sequences"] > 12 * 0.9


def test_time_limit_stops_with_a_checkpoint(data_dir, tiny_dir, tmp_path, monkeypatch):
    import itertools

    import time

    clock = itertools.count(0.0, 40.0)  # every perf_counter call advances 40 s
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    res = train(tiny_cfg(data_dir, tmp_path / "t", steps=50, time_limit=3.0, dev_every=0), target=load_target(str(tiny_dir)),
                log=lambda *a, **k: None)
    assert 0 < res.final_step < 50
    assert (tmp_path / "t" / "latest").read_text().strip() == f"step_{res.final_step:07d}"


def test_training_on_several_data_directories(data_dir, topk_dir, tiny_dir, tmp_path, capsys):
    """--data DIR --data DIR2 trains on both sets; directories prepared with other feature layers are refused."""
    from flashdraft.train.data import load_all

    both = load_all([str(data_dir), str(topk_dir)], features=True)
    assert len(both) == len(load_sequences(data_dir)) + len(load_sequences(topk_dir))
    other = tmp_path / "layer1"
    target = load_target(str(tiny_dir))
    prepare(target, ["abc def", "ghi jkl"], other, max_new_tokens=20, batch_size=2, feature_layer_ids=[1],
            progress=False)
    with pytest.raises(FlashdraftError, match="feature_layer_ids"):
        load_all([str(data_dir), str(other)], features=True)
    assert len(load_all([str(data_dir), str(other)])) == len(load_sequences(data_dir)) + 2  # tokens only: fine
    out = tmp_path / "run"
    assert main(["train", "--data", str(topk_dir), "--data", str(data_dir), "--out", str(out), "--target",
                 str(tiny_dir), "--offline", "--num-layers", "1", "--block-size", "4", "--steps", "2",
                 "--batch-size", "2", "--dtype", "float32", "--eval-sequences", "2", "--save-every", "2"]) == 0
    st = torch.load(out / "step_0000002" / "train_state.pt", weights_only=False)
    assert st["num_sequences"] > len(load_sequences(topk_dir))  # more than the first directory alone
    assert f"{topk_dir}/dev.jsonl" in capsys.readouterr().err  # dev τ on the split that exists (data_dir has none)
