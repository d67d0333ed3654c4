"""The runtime's shortened norm, RoPE and linear give the bits of the reference formulas
(Qwen2's RMSNorm and rotate-half RoPE as written in `transformers`, a linear over flattened
rows), so switching to them changed no model's output."""

import pytest
import torch
import torch.nn.functional as F

from failfast.model.packed import column_major
from failfast.model.transformer import RMSNorm, Rotary, apply_rotary, linear


def reference_rms_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = head_dim // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 384), (2, 7, 256), (1, 33, 6, 64)])
def test_rms_norm_matches_reference_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data = torch.randn(shape[-1], generator=g).to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), reference_rms_norm(norm.weight, x, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotary_matches_reference_bits(dtype: torch.dtype) -> None:
    head_dim, theta = 64, 10000.0
    positions = torch.tensor([0, 1, 5, 300, 2047])
    x = torch.randn(2, 4, len(positions), head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    rope = Rotary(head_dim, theta)(positions, dtype)
    assert torch.equal(apply_rotary(x, *rope), reference_rotary(x, positions, head_dim, theta))


def test_rms_norm_still_trains() -> None:
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("laid_out", [False, True])
def test_linear_matches_flattened_rows_bits(dtype: torch.dtype, laid_out: bool) -> None:
    """Batched, sliced (strided) and single-row inputs give the bits of one product over the
    flattened rows, with the weight as loaded or laid out column-major (`packed.column_major`)."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    if laid_out:
        weight = column_major(weight)
    hidden = torch.randn(3, 9, 64, generator=g).to(dtype)
    for x in (hidden, hidden[:, -3:], hidden[:1, -1:], hidden.transpose(0, 1)):
        flat = F.linear(x.reshape(-1, 64), weight, bias).view(*x.shape[:-1], 96)
        assert torch.equal(linear(x, weight, bias), flat)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kept_rope_tables_give_the_bits_of_the_per_forward_tables(dtype: torch.dtype) -> None:
    """`Rotary.rows` (what inference forwards read) against `Rotary.forward` (what they built
    before), for a verification's positions, one position, a packed forward's scattered
    positions, and positions past the first table (it grows)."""
    rotary = Rotary(64, 10000.0)
    for positions in (torch.arange(295, 300), torch.arange(7, 8), torch.tensor([3, 4, 40, 41, 42, 9]),
                      torch.arange(600, 700)):
        kept = rotary.rows(positions, dtype)
        assert all(torch.equal(a, b) for a, b in zip(kept, rotary(positions, dtype), strict=True))
        start, stop = int(positions[0]), int(positions[0]) + positions.numel()
        if torch.equal(positions, torch.arange(start, stop)):
            assert all(torch.equal(a, b) for a, b in zip(rotary.rows(slice(start, stop), dtype), kept, strict=True))
