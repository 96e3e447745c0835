"""The native kernels: the decode matmul (F.linear's numbers), the fused glue and the ragged attention (torch's),
a row's result independent of its batch, and a clean fallback."""

import os

import pytest
import torch
import torch.nn.functional as F

from flashdraft import kernels, packed

# CI builds it (g++ and ninja are there): a skip would hide a machine that silently lost the fast path.
REQUIRED = os.environ.get("FLASHDRAFT_REQUIRE_KERNEL") == "1"
needs_kernel = pytest.mark.skipif(not REQUIRED and not kernels.available(), reason="no C++ compiler or ninja")


def test_the_kernel_builds_where_ci_requires_it():
    if not REQUIRED:
        pytest.skip("FLASHDRAFT_REQUIRE_KERNEL is not set")
    assert kernels.available()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n_out,k", [(1, 1), (63, 7), (64, 64), (65, 200), (130, 48)])
def test_matvec_matches_f_linear(rows, n_out, k):
    torch.manual_seed(rows * 1000 + n_out + k)
    w, b, x = torch.randn(n_out, k), torch.randn(n_out), torch.randn(rows, k)
    pw = packed.pack_weight(w)
    assert isinstance(pw, packed.BlockedWeight) and pw.blocks.shape == ((n_out + 63) // 64, k, 64)
    torch.testing.assert_close(packed.linear(x, pw), F.linear(x, w), rtol=1e-5, atol=1e-5)
    got = packed.linear(x.view(1, rows, k), pw, b)  # [..., in] inputs and a bias, as the lean forward passes them
    torch.testing.assert_close(got, F.linear(x, w, b)[None], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: a verify of 7 positions computes each one exactly as a single-row decode step would."""
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    pw, x = packed.pack_weight(w), torch.randn(13, 96)
    batch = packed.linear(x, pw)
    for i in range(13):
        assert torch.equal(packed.linear(x[i:i + 1], pw)[0], batch[i])
    assert torch.equal(packed.linear(x[3:9], pw), batch[3:9])


def test_kernel_off_packs_for_onednn(monkeypatch):
    if not packed.packable("cpu", torch.float32):
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv("FLASHDRAFT_KERNEL", "0")
    w, x = torch.randn(80, 48), torch.randn(3, 48)
    pw = packed.pack_weight(w)
    assert not isinstance(pw, packed.BlockedWeight) and pw.is_mkldnn
    torch.testing.assert_close(packed.linear(x, pw), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_failed_build_falls_back_with_one_line(monkeypatch, tmp_path, capsys):
    def no_compiler(out):
        raise RuntimeError("Error building extension 'flashdraft_matvec'\nc++: command not found")
    monkeypatch.setattr(kernels, "library_dir", lambda: tmp_path / "k")
    monkeypatch.setattr(kernels, "_build", no_compiler)
    assert kernels.load_library() is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c++: command not found" in err[0] and "oneDNN" in err[0]


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 5, 576), (3, 4, 2, 16)])
def test_fused_rms_norm_and_silu_mul_match_torch(shape):
    from flashdraft.lean import rms_norm, silu_mul
    torch.manual_seed(0)
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    torch.testing.assert_close(torch.ops.flashdraft.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.ops.flashdraft.silu_mul(x), silu_mul(x), rtol=1e-5, atol=1e-6)
    strided = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]  # a non-contiguous input is read correctly
    torch.testing.assert_close(torch.ops.flashdraft.rms_norm(strided, w, 1e-5), rms_norm(strided, w, 1e-5),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.ops.flashdraft.silu_mul(strided), silu_mul(strided), rtol=1e-5, atol=1e-6)


def ragged_case(lens: list[int], widths: list[int], heads: int = 9, kv_heads: int = 3, dim: int = 64, seed: int = 0,
                tree: bool = False):
    """q [N, H, W, d], a cache buffer with room to spare (keys / values are views of it, as RaggedLayer hands them
    out), lens, and see [N, W, W]: each row's chain (or a random tree) over its own width, padding seeing itself."""
    from flashdraft.target import block_visibility
    g = torch.Generator().manual_seed(seed)
    n, w = len(lens), max(widths)
    q = torch.randn(n, heads, w, dim, generator=g)
    buf = torch.randn(n + 1, kv_heads, max(lens) + w + 5, dim, generator=g)
    vbuf = torch.randn(n + 1, kv_heads, max(lens) + w + 5, dim, generator=g)
    keys, values = buf[:n, :, :max(lens) + w], vbuf[:n, :, :max(lens) + w]
    see = torch.zeros(n, w, w, dtype=torch.bool)
    for i, k in enumerate(widths):
        parents = [int(torch.randint(-1, j, (1,), generator=g)) for j in range(k - 1)] if tree else None
        see[i, :k, :k] = block_visibility(parents, k)
        see[i, range(k, w), range(k, w)] = True
    return q, keys, values, torch.tensor(lens), see


def sdpa_reference(q, keys, values, lens, see, scale):
    """The same attention through torch's SDPA under the equivalent additive mask, in float64."""
    from flashdraft.target_batch import batch_mask
    n, w = see.shape[:2]
    width = int(lens.max()) + w
    mask = batch_mask(see, lens.tolist(), torch.float64, torch.device("cpu"))
    return F.scaled_dot_product_attention(q.double(), keys[:, :, :width].double(), values[:, :, :width].double(),
                                          attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2).float()


@needs_kernel
@pytest.mark.parametrize("lens,widths,tree", [([5], [1], False), ([0], [4], False), ([300], [8], True),
                                              ([7, 40, 3], [1, 1, 1], False), ([12, 3, 33, 20], [4, 2, 4, 1], False),
                                              ([9, 50], [8, 5], True)])
def test_ragged_attention_matches_sdpa(lens, widths, tree):
    q, keys, values, lens_t, see = ragged_case(lens, widths, tree=tree)
    got = torch.ops.flashdraft.ragged_attention(q, keys, values, lens_t, see, 0.125)
    assert got.shape == (len(lens), max(widths), 9, 64)
    torch.testing.assert_close(got, sdpa_reference(q, keys, values, lens_t, see, 0.125), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("lens,widths,tree", [([5], [1], False), ([7, 400, 3], [1, 1, 1], False),
                                              ([12, 3, 33, 20], [4, 2, 4, 1], False), ([9, 50], [8, 5], True)])
def test_ragged_attention_reads_bfloat16(lens, widths, tree):
    """bfloat16 q, K, V (a bfloat16 target's cache): computed in float32, the output rounded once to bfloat16."""
    q, keys, values, lens_t, see = (t.bfloat16() if t.is_floating_point() else t
                                    for t in ragged_case(lens, widths, tree=tree))
    got = torch.ops.flashdraft.ragged_attention(q, keys, values, lens_t, see, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == (len(lens), max(widths), 9, 64)
    want = sdpa_reference(q, keys, values, lens_t, see, 0.125)  # float64 over the same bfloat16 values
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=2 ** -8)  # one bfloat16 rounding


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_of_a_row_does_not_depend_on_the_batch_or_width(dtype):
    """Bit for bit: a row's outputs are the same alone, beside other rows, and padded to a wider block — so a verify
    attends exactly as the plain steps it replaces."""
    q, keys, values, lens, see = (t.to(dtype) if t.is_floating_point() else t
                                  for t in ragged_case([20, 7, 64], [3, 1, 8], seed=1))
    batch = torch.ops.flashdraft.ragged_attention(q, keys, values, lens, see, 0.125)
    for i, k in enumerate([3, 1, 8]):
        alone = torch.ops.flashdraft.ragged_attention(q[i:i + 1, :, :k], keys[i:i + 1], values[i:i + 1], lens[i:i + 1],
                                                      see[i:i + 1, :k, :k], 0.125)
        assert torch.equal(alone[0], batch[i, :k])
        for j in range(k):  # one position at a time on top of the cache: the plain steps
            steps = torch.ops.flashdraft.ragged_attention(q[i:i + 1, :, j:j + 1], keys[i:i + 1], values[i:i + 1],
                                                          lens[i:i + 1] + j, torch.ones(1, 1, 1, dtype=torch.bool),
                                                          0.125)
            assert torch.equal(steps[0, 0], batch[i, j])


@needs_kernel
def test_ragged_attention_refuses_what_it_cannot_read():
    q, keys, values, lens, see = ragged_case([4], [2])
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.flashdraft.ragged_attention(q, keys, values, lens + 10, see, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.flashdraft.ragged_attention(q.double(), keys, values, lens, see, 0.125)
