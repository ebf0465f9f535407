"""torchkiln::cuda_int4_mm_g<group> (kernels/cuda_int4.cu): its tile layout checked against the tensor
cores' A-operand fragment order on the CPU, its errors, the nvcc command line, and (on a GPU) its
products against the weights dequantized in float32, directly, through Int4Linear and inside
torch.compile, and its folded forms (norm, gated, bias, residual) against float64."""

from __future__ import annotations

import types

import pytest
import torch

from torchkiln.kernels import build, cuda_int4
from torchkiln.quantization.weight_only import Int4Linear

cuda = pytest.mark.cuda


def codes(n, k, seed=0):
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_pack_round_trips():
    q = codes(48, 320)
    packed = cuda_int4.pack(q)
    assert packed.shape == (3, 5, 32, 4) and packed.dtype == torch.int32
    assert torch.equal(cuda_int4.unpack(packed), q)


def test_each_lane_word_holds_its_mma_fragment():
    """The kernel makes register i of a lane's A operand from nibbles i and i + 4 of its word (shifted
    by 4i, low nibble of each half). PTX's m16n8k16 A fragment for lane l (g = l // 4, t = l % 4):
    registers (row g, cols 2t/2t+1), (row g+8, same), (row g, cols 2t+8/2t+9), (row g+8, same). The
    B operand of tile j of a 64-column block is x's values 16t + 4j .. 16t + 4j + 3 (the kernel's two
    16-byte loads a lane): MMA column 2t + e takes x column 16t + 4j + e, 2t + 8 + e takes 16t + 4j + 2 + e."""
    q = codes(32, 128, seed=1)
    packed = cuda_int4.pack(q)
    for b, c in ((0, 0), (1, 5), (0, 7), (1, 2)):
        words = packed[b, c // 4, :, c % 4]
        j, base = c % 4, 64 * (c // 4)
        for lane in range(32):
            v, g, t = int(words[lane]) & 0xFFFFFFFF, lane // 4, lane % 4
            got = []
            for i in range(4):
                r = v >> (4 * i)
                got += [r & 0xF, (r >> 16) & 0xF]
            x0 = base + 16 * t + 4 * j  # x columns this lane's b0 (x0, x0 + 1) and b1 (x0 + 2, x0 + 3) hold
            want = [(g, x0), (g, x0 + 1), (g + 8, x0), (g + 8, x0 + 1),
                    (g, x0 + 2), (g, x0 + 3), (g + 8, x0 + 2), (g + 8, x0 + 3)]
            assert got == [int(q[16 * b + r, col]) for r, col in want], (b, c, lane)


def test_scale_zero_pairs_sit_per_row_block_and_group():
    """pack_scales: row r's (scale, zero) for group i at [r // 16, i, r % 16], the scale's bf16 bits
    in the low half (the kernel's one 64-byte copy per row block and group); unpack_scales inverts it."""
    scale = torch.rand(48, 5).to(torch.bfloat16)
    zero = -torch.rand(48, 5).to(torch.bfloat16)  # negative: the sign bit sits in the word's bit 31
    sz = cuda_int4.pack_scales(scale, zero)
    assert sz.shape == (3, 5, 16) and sz.dtype == torch.int32
    for r, i in ((0, 0), (17, 3), (47, 4)):
        word = int(sz[r // 16, i, r % 16]) & 0xFFFFFFFF
        assert word & 0xFFFF == int(scale[r, i].view(torch.int16)) & 0xFFFF
        assert word >> 16 == int(zero[r, i].view(torch.int16)) & 0xFFFF
    got_scale, got_zero = cuda_int4.unpack_scales(sz)
    assert torch.equal(got_scale, scale) and torch.equal(got_zero, zero)


def test_bad_operands_name_what_is_wrong():
    q = cuda_int4.pack(codes(16, 64))
    s = torch.ones(16, 1, dtype=torch.bfloat16)
    sz = cuda_int4.pack_scales(s, s)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        cuda_int4.mm(x, q, sz, 64)
    why = cuda_int4._bad_operands

    def cudaish(t):  # the shape and dtype checks, past the device check (meta tensors, no GPU needed)
        return types.SimpleNamespace(is_cuda=True, dtype=t.dtype, shape=t.shape, dim=t.dim, numel=t.numel,
                                     is_contiguous=t.is_contiguous)

    meta = dict(device="meta")
    xm, qm, szm = x.to(**meta), q.to(**meta), sz.to(**meta)
    assert why(cudaish(xm), cudaish(qm), cudaish(szm), 64, -1) is None
    assert "x must be bfloat16" in why(cudaish(xm.float()), cudaish(qm), cudaish(szm), 64, -1)
    assert "1-32 contiguous rows of 64" in why(cudaish(torch.empty(33, 64, dtype=torch.bfloat16, **meta)),
                                               cudaish(qm), cudaish(szm), 64, -1)
    assert "group must be one of (64, 128, 256)" in why(cudaish(xm), cudaish(qm), cudaish(szm), 32, -1)
    assert "scale_zero must be pack_scales()' contiguous int32 [1, 1, 16]" in why(
        cudaish(xm), cudaish(qm), cudaish(s.to(**meta)), 64, -1)
    assert "config must be -1" in why(cudaish(xm), cudaish(qm), cudaish(szm), 64, 99)


def test_bad_folds_name_what_is_wrong():
    why = cuda_int4._bad_fold
    q = torch.empty(2, 1, 32, 4, dtype=torch.int32, device="meta")  # N 32, K 64
    x1, x2 = (torch.empty(r, 64, dtype=torch.bfloat16, device="meta") for r in (1, 2))
    g = torch.empty(64, device="meta")
    assert why(x1, q, g, False, None, None) is None
    assert why(x1, q, g, True, None, torch.empty(1, 16, dtype=torch.bfloat16, device="meta")) is None
    assert "norm takes one row of x and a float32 [64] scale, got 2 rows" in why(x2, q, g, False, None, None)
    assert "float32 [64] scale, got 1 rows and torch.bfloat16" in why(x1, q, g.bfloat16(), False, None, None)
    q16 = torch.empty(1, 1, 32, 4, dtype=torch.int32, device="meta")
    assert "gated needs a multiple of 32 rows of weights (16)" in why(x1, q16, None, True, None, None)
    assert "bias must be bf16 with 32 values" in why(x1, q, None, False, torch.empty(16, device="meta"), None)
    assert "resid must be a contiguous bf16 tensor of the result's 32 values, got (1, 16)" in why(
        x1, q, None, False, None, torch.empty(1, 16, dtype=torch.bfloat16, device="meta"))


def test_nvcc_command_line_passes_host_options_through_xcompiler(tmp_path):
    line = build.command("/usr/local/cuda/bin/nvcc", tmp_path / "k.cu", tmp_path / "k.so", ["-DX"], ["-lc10"])
    assert line[line.index("-fPIC") - 1] == "-Xcompiler"
    assert not any(a.startswith("-Wl,") for a in line) and "-rpath" in line
    cxx = build.command("/usr/bin/c++", tmp_path / "k.cpp", tmp_path / "k.so", [], [])
    assert "-fPIC" in cxx and "-Xcompiler" not in cxx


def test_no_nvcc_is_a_reason(monkeypatch):
    if not torch.cuda.is_available():
        assert "CUDA" in cuda_int4.load()
    monkeypatch.setenv("CUDA_HOME", "/no/such/cuda")
    monkeypatch.setenv("PATH", "/no/such/bin")
    monkeypatch.setattr(build.os, "access", lambda *a: False)
    assert build.nvcc() is None


def reference(x, q4):
    n, k = q4.out_features, q4.in_features
    q = cuda_int4.unpack(q4.packed).float().view(n, k // q4.group, q4.group)
    scale, zero = (t.float() for t in cuda_int4.unpack_scales(q4.scale_zero))
    w = (q * scale[..., None] + zero[..., None]).view(n, k)
    return x.float() @ w.T


@pytest.fixture(scope="module")
def built():
    for group in cuda_int4.GROUPS:  # one library each
        why = cuda_int4.load(group=group)
        assert why is None, why  # on the GPU machine nvcc is present: it must build


@cuda
@pytest.mark.parametrize("group", cuda_int4.GROUPS)
@pytest.mark.parametrize("rows", [1, 3, 8, 20, 32, 50, 70])
def test_products_match_the_dequantized_weight(built, group, rows):
    """Within bf16's output rounding (2^-8 relative, per output) of the float32 product of the same
    codes; 20 and 32 rows run as one launch (3 and 4 column blocks), 50 as two, 70 dequantize for cuBLAS."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 272, bias=True, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear(lin, group, mma=True)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    want = reference(x, q4) + lin.bias.float()
    got = q4(x).float()
    assert got.shape == (rows, 272)
    assert ((got - want).abs() <= 2 ** -7 * want.abs() + 2e-2).all(), float((got - want).abs().max())
    # and the codes are the layer's own: within int4's rounding of the float weight
    err = (got - (x.float() @ lin.weight.float().T + lin.bias.float())).norm() / want.norm()
    assert err < 0.1


@cuda
@pytest.mark.parametrize("config", range(cuda_int4.CONFIGS))
def test_every_launch_shape_gives_the_same_product(built, config):
    torch.manual_seed(1)
    lin = torch.nn.Linear(1024, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear(lin, 128, mma=True)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    got = cuda_int4.mm(x, q4.packed, q4.scale_zero, 128, config).float()
    want = reference(x, q4)
    assert float((got - want).norm() / want.norm()) < 4e-3


@cuda
def test_inside_torch_compile_and_a_cuda_graph(built):
    torch.manual_seed(2)
    lin = torch.nn.Linear(256, 64, bias=False, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear(lin, 64, mma=True)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    eager = q4(x)
    compiled = torch.compile(q4, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = compiled(x)
    assert torch.equal(got, eager)


@cuda
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(built):
    """Every launch uses the layer's warps, so a row's sums run in the same order at 1, 8, 20 or 40
    rows (a batched decode then matches the same rows decoded alone)."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear(lin, 128, mma=True)
    x = torch.randn(40, 4096, device="cuda", dtype=torch.bfloat16)
    for batch in (q4(x), torch.cat([q4(x[:20]), q4(x[20:])])):
        for i in (0, 3, 11, 19, 33, 39):
            assert torch.equal(q4(x[i:i + 1]), batch[i:i + 1])


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


FOLDS = [(True, False, False, False), (True, True, False, False), (False, False, False, True),
         (True, False, True, False), (False, False, True, True), (True, True, True, True)]


@cuda
@pytest.mark.parametrize("group", cuda_int4.GROUPS)
@pytest.mark.parametrize("norm,gated,bias,resid", FOLDS)
def test_folded_forms_match_float64(built, group, norm, gated, bias, resid):
    """One row with the norm prologue (x * g staged in shared memory, rsqrt(mean(x^2) + eps) on the
    sums), the gated epilogue (silu(gate) * up, gate and up rows paired in a block), bias and residual,
    against float64 on the same codes, at every launch shape the fold offers: within bf16's rounding
    of x * g (2^-9 relative) and of the output."""
    torch.manual_seed(4)
    n = 2 * 272 if gated else 272
    lin = torch.nn.Linear(512, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear(lin, group, mma=True)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16) * 3
    g = torch.rand(512, device="cuda") + 0.5 if norm else None
    r = torch.randn(1, 272, device="cuda", dtype=torch.bfloat16) if resid else None
    codes_ = cuda_int4.unpack(q4.packed).double().view(n, 512 // group, group)
    scale, zero = (t.double() for t in cuda_int4.unpack_scales(q4.scale_zero))
    w = (codes_ * scale[..., None] + zero[..., None]).view(n, 512)
    h = x.double() if g is None else _rms(x.double(), 1e-5) * g.double()
    want = h @ w.T + (lin.bias.double() if bias else 0)
    if gated:
        want = torch.nn.functional.silu(want[:, :272]) * want[:, 272:]
    if resid:
        want = want + r.double()
    fold = "gated" if gated else "norm" if norm else None
    for config in cuda_int4.FOLD_CONFIGS[fold]:
        got = cuda_int4.mm(x, q4.packed, q4.scale_zero, group, config, g, 1e-5, gated,
                           lin.bias if bias else None, r)
        assert got.shape == (1, 272) and got.dtype == torch.bfloat16
        err = float((got.double() - want).norm() / want.norm())
        assert err < 6e-3, (config, err)


@cuda
def test_a_folded_norm_row_matches_the_plain_kernel_on_the_normalised_row(built):
    """The norm prologue against the plain kernel fed the row normalised in float32 outside: the same
    products up to bf16 rounding of x * g and of the output, and tune() picks one of the fold's shapes."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear(lin, 128, mma=True)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(4096, device="cuda") + 0.5
    config = cuda_int4.tune(1024, 4096, 128, x.device, "norm")
    assert config in cuda_int4.FOLD_CONFIGS["norm"]
    got = cuda_int4.mm(x, q4.packed, q4.scale_zero, 128, config, g, 1e-6).float()
    plain = q4((_rms(x.float(), 1e-6) * g).to(torch.bfloat16)).float()
    assert float((got - plain).norm() / plain.norm()) < 8e-3
