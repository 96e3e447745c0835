"""Threads that follow the machine (flashdraft/threads.py): the cores other processes leave, a change only when two
windows agree, off where the user chose, and a thread count that cannot change what the fused forward computes."""

import pytest
import torch
from test_kernels import needs_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from flashdraft import lean, threads
from flashdraft import target as T
from flashdraft.decoding.decoder import Decoder
from flashdraft.packed import pack_linears
from flashdraft.target_batch import forward_batch


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_threads_for_leaves_the_cores_other_processes_hold():
    assert threads.threads_for(0.0, 2, 2) == 2  # a free machine: every core
    assert threads.threads_for(0.2, 2, 2) == 2  # a client's HTTP handling is not a core's worth
    assert threads.threads_for(1.0, 2, 2) == 1  # two spinning processes got one core beside our two threads
    assert threads.threads_for(1.4, 2, 2) == 1  # … and 1.33 beside one thread: never below one
    assert threads.threads_for(2.0, 16, 16) == 14
    assert threads.threads_for(0.0, 16, 8) == 8  # never more than the user's torch had


class Machine:
    """Fake clock and CPU counters: the other processes' load per second of wall time, ours at one core."""

    def __init__(self):
        self.t = self.busy = self.own = 0.0
        self.others = 0.0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.own += seconds
        self.busy += seconds * (1 + self.others)


def governed(m: Machine) -> threads.Governor:
    return threads.Governor(2, 2, busy_s=lambda: m.busy, own_s=lambda: m.own, clock=lambda: m.t)


def run(g: threads.Governor, m: Machine, seconds: float, cycle_s: float = 0.05) -> list[int]:
    """Cycles of cycle_s for `seconds`, following the load each cycle → the thread count after each."""
    seen = []
    for _ in range(round(seconds / cycle_s)):
        m.advance(cycle_s)
        g.follow()
        seen.append(torch.get_num_threads())
    return seen


def test_the_governor_drops_to_the_free_cores_after_two_windows_and_comes_back(two_threads):
    m = Machine()
    g = governed(m)
    assert set(run(g, m, 3.0)) == {2}  # a free machine keeps every core
    m.others = 1.0
    seen = run(g, m, 3.0)
    assert seen[0] == 2 and seen[-1] == 1
    assert 2 * threads.WINDOW_S <= seen.index(1) * 0.05 + 0.05 <= 3 * threads.WINDOW_S + 0.05  # two windows agreed
    m.others = 0.0
    seen = run(g, m, 3.0)
    assert seen[0] == 1 and seen[-1] == 2


def test_one_busy_window_or_an_idle_spell_changes_nothing(two_threads):
    m = Machine()
    g = governed(m)
    run(g, m, 1.0)
    m.others = 1.0
    run(g, m, threads.WINDOW_S)  # one window of load, then free again
    m.others = 0.0
    assert set(run(g, m, 2.0)) == {2}
    m.others = 1.0  # load that came and went while no cycle ran (the server idle): not a reading of decoding
    m.busy += 10.0
    m.t += 10.0
    m.others = 0.0
    assert set(run(g, m, 2.0)) == {2}


def test_the_governor_is_off_where_the_user_chose_the_threads(monkeypatch):
    monkeypatch.setattr(threads, "_decided", False)
    monkeypatch.setattr(threads, "_pinned", False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.governor() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        threads.pin(before)
        assert threads.governor() is None
    finally:
        monkeypatch.setattr(threads, "_pinned", False)


def realistic_attention_target() -> torch.nn.Module:
    """Two layers with the default target's attention shape (9 query heads of 64 over 3 K/V heads): the shape at
    which torch's single-query attention splits the keys across threads."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=576, intermediate_size=256, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, max_position_embeddings=1024, initializer_range=0.2,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    pack_linears(model)
    assert T.use_lean(model)
    return model


@needs_kernel
@torch.inference_mode()
def test_the_fused_forward_computes_the_same_bits_at_any_thread_count(two_threads):
    """The fused float32 forward, the one on which the decoder follows the load: every pass it runs (prefill,
    single-position steps of one and several rows, padded verifies) gives the same logits at 1 and 2 threads, bit for
    bit, so a change of threads mid-request cannot change a token."""
    model = realistic_attention_target()
    assert lean.current(model).fused
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 41, 170)]

    def passes() -> list[torch.Tensor]:
        dec = Decoder(model, None, slots=3, prefill_chunk=None)
        assert dec.follow_load
        qs = [dec.join(p, max_new_tokens=8)[0] for p in prompts]
        out = [T.forward(model, torch.tensor(prompts[0][:1]), 0, T.new_cache(model), []).logits]  # a 1-token prefill
        for w in (1, 4, 8):  # plain steps and padded verifies of ragged rows on top of 41–300 cached positions
            blocks = [[q.tokens[-1]] * (w if i != 1 else max(1, w - 2)) for i, q in enumerate(qs)]
            out += [o.logits for o in forward_batch(model, blocks, [None] * 3, dec.cache, [])]  # nothing committed
        alone = T.new_cache(model)  # one request on its own cache (generate): its prefill, then a step
        out.append(T.forward(model, torch.tensor(prompts[1]), 0, alone, []).logits)
        out.append(T.forward(model, torch.tensor([5]), 41, alone, []).logits)
        return out

    torch.set_num_threads(1)
    one = passes()
    torch.set_num_threads(2)
    two = passes()
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_the_server_loads_on_one_thread_and_hands_the_threads_to_the_decode_thread(two_threads, monkeypatch):
    """libgomp keeps a team per thread that starts parallel ops, and when the teams outnumber the cores every team
    sleeps at its barriers (a server step 29 → 38 ms on 2 cores): the loading thread drops to one thread and the
    decode thread runs at the count it had."""
    import threading

    from helpers import random_drafter, tiny_target
    from serve_helpers import char_tokenizer

    from flashdraft.decoding import DecodeSettings
    from flashdraft.models import Target
    from flashdraft.serve.worker import Worker

    assert threads.hand_over() == 2 and torch.get_num_threads() == 1
    model = tiny_target("llama", seed=3)
    seen, make_decoder = {}, Worker.decoder

    def decoder(self):
        seen["decode thread"] = (threading.current_thread().name, torch.get_num_threads())
        return make_decoder(self)

    monkeypatch.setattr(Worker, "decoder", decoder)
    worker = Worker(Target(model, char_tokenizer(), "tiny"), random_drafter(model, block_size=4), DecodeSettings(),
                    threads=2)
    worker.start()
    worker.stop()
    worker.thread.join(timeout=60)
    assert seen["decode thread"] == ("flashdraft-decode", 2)
    assert torch.get_num_threads() == 1  # this thread kept one
