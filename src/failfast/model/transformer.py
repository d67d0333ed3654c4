"""Qwen2/Qwen3-architecture decoder (RMSNorm, RoPE, SwiGLU, GQA; q/k/v bias for Qwen2,
per-head q/k RMSNorm for Qwen3) over a KVCache.

Parameter names match Hugging Face `Qwen2ForCausalLM` / `Qwen3ForCausalLM`, so checkpoints
load unchanged.
Two attention patterns share one implementation, both derived from absolute positions:
causal (a query at q sees keys k <= q) and block diffusion (q sees k iff q//B >= k//B).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.module import (register_module_buffer_registration_hook, register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from failfast.model import cpu_kernels
from failfast.model.config import ModelConfig
from failfast.model.kv_cache import KVCache
from failfast.model.ragged import Ragged
from failfast.model.shapes import key_bucket
from failfast.model.tiled import MAX_ROWS, TiledWeight

HALF_DTYPES = (torch.bfloat16, torch.float16)
WIDE_DTYPES = (torch.float32, torch.float64)
# Rows per 16-bit matmul call. CPU kernels pick their blocking by row count, and past ~32 rows
# (34 for the MLP's down projection on an AMX CPU, 48 for long-context attention on an
# AVX512-BF16 one) a row's rounding changes; at most this many rows per call, a k-token
# verification rounds like k one-token forwards (docs/design.md, "Precision").
ROW_BLOCK = 32
# Keys per 16-bit attention reduction: CPU kernels reduce up to 1,024 in one block.
KEY_BLOCK = 1024


def row_blocked(op, x: Tensor) -> Tensor:
    """`op(x)` computed on at most ROW_BLOCK rows (dim -2) at a time, for 16-bit inputs:
    each row's result then does not depend on how many rows share the call. Under autocast
    (training, never the exact inference path) whole calls are faster and nothing needs it."""
    if x.dtype not in HALF_DTYPES or x.shape[-2] <= ROW_BLOCK or torch.is_autocast_enabled(x.device.type):
        return op(x)
    return torch.cat([op(part) for part in x.split(ROW_BLOCK, dim=-2)], dim=-2)


def linear(x: Tensor, weight: Tensor | TiledWeight, bias: Tensor | None = None) -> Tensor:
    """`F.linear` over the flattened rows of x, row-blocked in 16 bits; a weight packed by
    `model/packed.py` goes to oneDNN's packed product (a `torch._mkldnn` tensor) or, for up
    to `tiled.MAX_ROWS` rows, to the tiled float32 kernel (a `TiledWeight`). A contiguous
    float32/float64 x goes to `F.linear` as it is (the same one product, two ops less; a
    strided one would take a batched product that rounds differently)."""
    if isinstance(weight, TiledWeight):
        if weight.takes(x, bias):
            return weight.product(x, bias)
        weight = weight.weight
    if x.dtype not in HALF_DTYPES and not weight.is_mkldnn and x.is_contiguous():
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if weight.is_mkldnn:
        op = lambda part: torch.ops.mkldnn._linear_pointwise(part, weight, bias, "none", [], "")  # noqa: E731
    else:
        op = lambda part: F.linear(part, weight, bias)  # noqa: E731
    return row_blocked(op, rows).view(*x.shape[:-1], weight.shape[0])


def version(*modules: nn.Module) -> int | None:
    """The sum of the in-place change counters of the modules' own parameters and buffers: a
    packed or fused copy made from them is stale once it moves (a `load_state_dict`, an
    optimizer step; counters only grow). None for inference tensors, which have none. Read on
    every call of a packed layer, so from the modules' dicts (~1.4 us, against ~8 us through
    `parameters()`)."""
    try:
        return sum(t._version for m in modules for t in (*m._parameters.values(), *m._buffers.values())
                   if t is not None)
    except RuntimeError:
        return None


class PackedCopies:
    """How many times packed copies or fused products were set or dropped, anywhere: a cached
    view of a model's packed weights (`Transformer._kernel_layers`) is stale once it moves."""

    generation = 0

    @classmethod
    def changed(cls, *_: object) -> None:
        cls.generation += 1


# A parameter, buffer or submodule assigned to any module (a replaced weight or layer, a
# `load_state_dict(assign=True)`) changes no version counter, so it counts as a change too.
for _register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                  register_module_module_registration_hook):
    _register(PackedCopies.changed)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose 16-bit rows do not depend on the batch.
    `packed`: the weight prepacked for CPU inference (`model/packed.py`, set by `pack`), or
    None; ignored while the weight trains or once it changed in place."""

    packed: Tensor | TiledWeight | None = None
    packed_from: int | None = None  # `version` when it was packed

    def pack(self, packed: Tensor | TiledWeight | None) -> None:
        self.packed, self.packed_from = packed, version(self)
        PackedCopies.changed()

    def fresh_packed(self) -> Tensor | TiledWeight | None:
        """The packed copy, unless there is none, the weight trains or it changed since."""
        fresh = self.packed is not None and not trains(self) and version(self) == self.packed_from
        return self.packed if fresh else None

    def forward(self, x: Tensor) -> Tensor:
        packed = self.fresh_packed()
        return linear(x, self.weight if packed is None else packed, self.bias)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's hook behind .to() and the like
        """A packed copy left in another dtype or on another device by a conversion is dropped."""
        super()._apply(fn, recurse)
        if self.packed is not None and dtype_and_device(self.packed) != dtype_and_device(self.weight):
            self.packed = None
        PackedCopies.changed()
        return self


@dataclass(frozen=True, eq=False)
class Product:
    """A fused product (`fuse_projections`): x times a packed weight (the layers' weights side
    by side), plus their biases."""

    weight: Tensor | TiledWeight
    bias: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def dtype_and_device(t: Tensor | None) -> tuple[torch.dtype, torch.device] | None:
    return None if t is None else (t.dtype, t.device)


class FusesProjections(nn.Module):
    """A module with one fused product (`fuse_projections`) built from some of its layers'
    weights; a conversion (`.to()`, `.double()`...) that changes those weights drops it, and
    while they train or once they changed in place the layers run themselves (`fused`)."""

    fused_attr: str  # where the product is kept
    fused_layers: tuple[str, ...]  # the layers it is built from, outputs side by side
    fused_from: int | None = None  # the layers' `version` when it was built

    def set_fused(self, product: Callable[[Tensor], Tensor]) -> None:
        setattr(self, self.fused_attr, product)
        self.fused_from = version(*self.layers_fused())
        PackedCopies.changed()

    def layers_fused(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.fused_layers]

    def fused(self) -> Callable[[Tensor], Tensor] | None:
        """The fused product, or None: none built, a layer trains, or a layer changed since."""
        product = getattr(self, self.fused_attr)
        if product is None:
            return None
        layers = self.layers_fused()
        if trains(layers[0]) or version(*layers) != self.fused_from:
            return None
        return product

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001
        before = self._float_layout()
        super()._apply(fn, recurse)
        if self._float_layout() != before:
            setattr(self, self.fused_attr, None)
        PackedCopies.changed()
        return self

    def _float_layout(self) -> tuple[torch.dtype, torch.device] | None:
        """Dtype and device of the first fused layer's first float tensor (an int8 layer's scales)."""
        layer = getattr(self, self.fused_layers[0])
        floats = (t for t in [*layer.parameters(), *layer.buffers()] if t.is_floating_point())
        return dtype_and_device(next(floats, None))


def attention_mask(q_pos: Tensor, k_pos: Tensor, block_size: int | None) -> Tensor:
    """Boolean [..., Tq, Tk] mask for query positions [..., Tq]: True where a query may attend
    to a key (causal, or block-causal: every key of its own and earlier blocks)."""
    if block_size is None:
        return k_pos <= q_pos[..., None]
    return (k_pos // block_size) <= (q_pos[..., None] // block_size)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in WIDE_DTYPES and self.weight.dtype == x.dtype and x.device.type == "cpu":
            if (kernels := cpu_kernels.runs_on(x, self.weight)) is not None:  # float32 inference
                return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
            # one call instead of nine, with the same bits in these dtypes on a CPU (docs/design.md,
            # "Fewer ops per forward"; a GPU's fused kernel may round otherwise)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 at least (as Qwen2 does), then return in the input dtype.
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


TABLE_CHUNK = 32  # positions per call building `Rotary.rows`' tables


def _numel(positions: Tensor | slice) -> int:
    return positions.stop - positions.start if isinstance(positions, slice) else positions.numel()


class Rotary(nn.Module):
    """RoPE tables computed in float32 from positions, as the reference implementation does."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponent), persistent=False)
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}  # `rows`

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin [T, D] for positions [T] (shared by the rows of a batch; a packed
        forward's rows are one sequence): what `apply_rotary` takes. The sine's first half is
        negated here once per forward, so that rotating is four ops, not seven."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        return emb.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)

    def rows(self, positions: Tensor | slice, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`forward`'s tables for positions (a slice: contiguous views), read from tables of
        positions 0.. kept per dtype and device: ten ops less per inference forward. Built
        TABLE_CHUNK positions per call, so every element takes the vectorised sin and cos (a
        chunk holds whole vectors and stays on one thread), as a forward's table of T x D
        elements does when T x D is a multiple of 32; elsewhere (D = 100, odd T) PyTorch took
        the scalar functions for the last elements, so the same position could round apart in
        a one-token and a k-token forward, and with the tables it cannot."""
        end = (positions.stop if isinstance(positions, slice) else int(positions.max()) + 1) if _numel(positions) else 0
        cos, signed_sin = self.tables(end, dtype)
        return cos[positions], signed_sin[positions]

    def tables(self, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The kept tables (cos and signed sin [P, D] for positions 0 .. P-1, P >= end), grown
        to twice their size (at least 256 positions) when they end before `end`."""
        key = (dtype, self.inv_freq.device)
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] < end:
            size = -(-max(end, 2 * (0 if tables is None else tables[0].shape[0]), 256) // TABLE_CHUNK) * TABLE_CHUNK
            parts = [self(torch.arange(lo, lo + TABLE_CHUNK, device=self.inv_freq.device), dtype)
                     for lo in range(0, size, TABLE_CHUNK)]
            tables = self._tables[key] = (torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))
        return tables


def batch_invariant_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention whose result for a query does not depend on how many queries share the call.

    16-bit verification must round exactly like one-token decoding, or a near-tie flips a
    token and the output is no longer the target's (docs/design.md, "Precision"). PyTorch's
    CPU SDPA picks different kernels for one query and for several; its 16-bit matmuls, with
    float32 accumulation over the same order, do not, at up to ROW_BLOCK rows per call. So:
    grouped-query matmuls, row-blocked, softmax in float32 (or wider), masked keys
    contributing exact zeros.
    """
    b, heads, t, d = q.shape
    groups = k.shape[1]
    per_group = heads // groups  # kv head j serves query heads j*per_group .. (j+1)*per_group-1
    compute = torch.promote_types(q.dtype, torch.float32)
    keys = k.transpose(-1, -2)
    scores = row_blocked(lambda rows: rows @ keys, q.reshape(b, groups, per_group * t, d)).to(compute) * d ** -0.5
    scores = scores.view(b, groups, per_group, t, -1)
    if mask is not None:
        scores = scores.masked_fill(~(mask[:, :, None] if mask.dim() == 4 else mask), float("-inf"))
    weights = scores.softmax(-1).to(v.dtype).view(b, groups, per_group * t, -1)
    return row_blocked(lambda rows: key_blocked_product(rows, v), weights).view(b, heads, t, d)


def per_row_mask(mask: Tensor | None, rows: int) -> Tensor | None:
    """A boolean attention mask ([T, S], or [rows, 1, T, S] for a packed forward) as a
    [rows, T, S] view: what the float32 attention kernel takes."""
    if mask is None:
        return None
    return (mask[:, 0] if mask.dim() == 4 else mask).expand(rows, *mask.shape[-2:])


def key_blocked_product(weights: Tensor, v: Tensor) -> Tensor:
    """`weights @ v` summed over fixed KEY_BLOCK-wide key ranges (float32 partial sums).

    A CPU kernel splits a long reduction differently for different lengths, so a query that
    attends to 1,000 keys would round differently in a forward whose key range is 1,030 long
    (the masked keys are exact zeros, but the split moves). Fixed ranges at absolute key
    positions make each range's product one kernel block, whatever the call's length.
    """
    if weights.dtype not in HALF_DTYPES or v.shape[-2] <= KEY_BLOCK:
        return weights @ v
    total = None
    for lo in range(0, v.shape[-2], KEY_BLOCK):
        part = (weights[..., lo:lo + KEY_BLOCK] @ v[..., lo:lo + KEY_BLOCK, :]).float()
        total = part if total is None else total + part
    return total.to(v.dtype)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE in the rotate-half layout: x * cos + [-x2, x1] * sin, written as x * cos + [x2, x1]
    * [-sin1, sin2] (`Rotary`'s tables). Negating a factor is exact, so the bits are the
    reference formula's; `roll` swaps the halves in one op (docs/design.md, "Fewer ops per
    forward"). Float32 inference on [B, heads, T, D] with [T, D] tables is one kernel call with
    the same bits (docs/design.md, "Float32 CPU kernels")."""
    if (x.dim() == 4 and cos.shape == signed_sin.shape == x.shape[-2:] and cos.dtype == signed_sin.dtype == x.dtype
            and (kernels := cpu_kernels.runs_on(x, cos, signed_sin)) is not None):
        return kernels.rotary(x, cos.contiguous(), signed_sin.contiguous())
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(FusesProjections):
    # 16-bit attention over a cache that rounds the same for one query and for many (what
    # verification needs); a drafter's model turns it off for SDPA's faster kernels
    # (`fast_drafting_attention`): drafts only propose, so their rounding never changes the output.
    batch_invariant = True
    # q, k and v projections as one product (a packed or int8 weight: `fuse_projections`)
    qkv: Callable[[Tensor], Tensor] | None = None
    fused_attr, fused_layers = "qkv", ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig, in_features: int | None = None) -> None:
        """`in_features`: the width of what q/k/v project (the hidden size unless given: an
        EAGLE-3 layer reads token embedding and feature side by side)."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        width = in_features or cfg.hidden_size
        self.q_proj = Linear(width, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(width, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = Linear(width, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's query and key
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def queries(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Rotated queries [B, heads, T, head_dim] of hidden states [B, T, hidden]."""
        return self._rotated_queries(self.q_proj(x), rope)

    def keys_values(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Rotated keys and values [B, kv_heads, T, head_dim] of hidden states [B, T, hidden]
        (a target-conditioned drafter also projects target features with them)."""
        return self._rotated_keys_values(self.k_proj(x), self.v_proj(x), rope)

    def queries_keys_values(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """`queries` and `keys_values` of the same hidden states, from one fused product at inference."""
        q, k, v = self._projections(x)
        return (self._rotated_queries(q, rope), *self._rotated_keys_values(k, v, rope))

    def _rotated_queries(self, q: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        b, t, _ = q.shape
        q = q.view(b, t, self.n_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        return apply_rotary(q.transpose(1, 2), *rope)

    def _rotated_keys_values(self, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        b, t, _ = k.shape
        k = k.view(b, t, self.n_kv, self.head_dim)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rotary(k.transpose(1, 2), *rope), v

    def _projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v projections of x: one packed product when `qkv` is set (inference), else three."""
        if (qkv := self.fused()) is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.n_kv * self.head_dim
        return qkv(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None,
                cache: KVCache | None, layer: int, start: int | Ragged, context_end: int | None) -> Tensor:
        """`start`: the first position of every row, or a packed forward of several cache rows
        (`Ragged`; x is [1, N, hidden], attention runs on its padded layout)."""
        b, t, _ = x.shape
        q, k, v = self.queries_keys_values(x, rope)
        if isinstance(start, Ragged):
            k, v = cache.write_ragged(layer, start, k[0].transpose(0, 1), v[0].transpose(0, 1), context_end)
            q = start.to_padded(q[0].transpose(0, 1)).transpose(1, 2)  # [rows, heads, width, head_dim]
        elif cache is not None:
            k, v = cache.write(layer, start, k, v, context_end)
        if cache is not None and self.head_dim <= 128 and (kernels := cpu_kernels.runs_on(q, k, v)) is not None:
            # float32 inference: each query in one fixed order, [B, T, heads, head_dim] (docs/design.md,
            # "Float32 CPU kernels")
            out = kernels.attend(q, k, v, per_row_mask(mask, q.shape[0]), self.head_dim ** -0.5)
        elif cache is not None and q.dtype in HALF_DTYPES and self.batch_invariant:
            out = batch_invariant_attention(q, k, v, mask).transpose(1, 2)  # inference in 16 bits: lossless verification
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
            out = out.transpose(1, 2)
        if isinstance(start, Ragged):
            out = start.to_packed(out)[None]
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


def fast_drafting_attention(model: nn.Module) -> None:
    """Let a drafter's model use SDPA in 16 bits (about 0.2 ms less per pass of the embedded
    block-diffusion drafter). Never for a model that also verifies."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.batch_invariant = False


def trains(layer: nn.Module) -> bool:
    """True when a layer's float weight takes gradients: a fused or packed copy would go stale."""
    weight = getattr(layer, "weight", None)
    return weight is not None and weight.requires_grad


def side_by_side(layers: Sequence[nn.Module]) -> tuple[Tensor, Tensor | None]:
    """The weight [sum of outs, in] and bias (None without biases) of float linear layers whose
    outputs are concatenated: what a fused product is built from."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    biases = [layer.bias for layer in layers]
    return weight, None if biases[0] is None else torch.cat([b.detach() for b in biases])


def fuse_projections(model: nn.Module, fuse: Callable[[Sequence[nn.Module]], Callable[[Tensor], Tensor] | None]) -> None:
    """Give every attention's q/k/v and every MLP's gate/up projections one product each:
    `fuse(layers)` builds it from the layers (their outputs side by side), or returns None to
    leave the module as it is. It is a plain callable, not a module, so state dicts keep
    Hugging Face's names. Fewer, wider matmul calls: 4 per layer instead of 7."""
    for module in model.modules():
        if isinstance(module, FusesProjections) and (product := fuse(module.layers_fused())):
            module.set_fused(product)


class MLP(FusesProjections):
    gate_up: Callable[[Tensor], Tensor] | None = None  # gate and up projections as one product (`fuse_projections`)
    fused_attr, fused_layers = "gate_up", ("gate_proj", "up_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if (gate_up := self.fused()) is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = gate_up(x).chunk(2, dim=-1)
        if (kernels := cpu_kernels.runs_on(gate, up)) is not None:  # float32 inference: one fixed exp per element
            rows = kernels.swiglu(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
            return self.down_proj(rows.view(*gate.shape))
        return self.down_proj(F.silu(gate) * up)


class LayerKernelWeights(NamedTuple):
    """A decoder layer's weights as `cpu_kernels.decoder_layer` takes them."""

    input_norm: Tensor
    qkv_tiles: Tensor
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o_tiles: Tensor
    post_norm: Tensor
    gate_up_tiles: Tensor
    down_tiles: Tensor
    eps: float
    embedded_norm: Tensor | None = None  # an EAGLE-3 layer's: q/k/v read [normed embedding, normed x]


class KernelLayers(NamedTuple):
    """What a forward's layers pass to the one-call kernel besides their weights: which keys a
    query reads and the attention pattern. A forward of every cache row at `start` gives
    `read_end` and `block_size` (0: causal); a packed forward of several rows (`Ragged`)
    gives `places` [3, N]: each token's cache row, position and key end."""

    weights: list[LayerKernelWeights]
    heads: int
    scale: float
    read_end: int = 0
    block_size: int = 0
    places: Tensor | None = None

    def run(self, layer: int, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache, start: int | Ragged) -> Tensor:
        kernels = cpu_kernels.kernels()
        args = kernel_layer_args(self.weights[layer], x, rope, cache, layer)
        if self.places is not None:
            return kernels.packed_decoder_layer(*args, self.places, self.heads, self.scale)  # type: ignore[union-attr]
        return kernels.decoder_layer(*args, start, self.read_end, self.block_size, self.heads,  # type: ignore[union-attr]
                                     self.scale)


def kernel_layer_args(w: LayerKernelWeights, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache,
                      layer: int) -> tuple:
    """The arguments the one-call kernels take first: input, weights, RoPE tables, the layer's cache."""
    return (x.contiguous(), w.input_norm, w.qkv_tiles, w.qkv_bias, w.q_norm, w.k_norm, w.o_tiles, w.post_norm,
            w.gate_up_tiles, w.down_tiles, w.eps, rope[0], rope[1], cache.keys[layer], cache.values[layer])


_VERSION = attrgetter("_version")


@dataclass(frozen=True, eq=False)
class KernelPlan:
    """A model's `LayerKernelWeights` (None: a layer runs op by op) and the state they were read
    in: the packing generation (which module assignments move too), its parameters' summed
    in-place change counters and which of them take gradients (None where they have no
    counters: read again every time). The kernels read that state in one call (`watch`, a
    `ParameterWatch`), Python where they do not run."""

    weights: list[LayerKernelWeights] | None
    tensors: list[Tensor]
    state: tuple | None
    watch: object | None = None  # the tensors as the kernels' ParameterWatch
    stack: list = field(default_factory=list)  # the weights as the kernels' LayerStack, once built
    parts: list = field(default_factory=list)  # what a whole forward takes besides (`Transformer._whole_parts`)

    @staticmethod
    def state_of(tensors: list[Tensor], watch: object | None = None) -> tuple | None:
        if watch is not None:
            read = cpu_kernels.kernels().parameter_state(watch)  # type: ignore[union-attr]
            return None if read is None else (PackedCopies.generation, read[0], tuple(read[1]))
        try:
            return (PackedCopies.generation, sum(map(_VERSION, tensors)),
                    tuple(i for i, t in enumerate(tensors) if t.requires_grad))
        except RuntimeError:  # inference tensors keep no version counter
            return None

    def stale(self) -> bool:
        return self.state is None or self.state != KernelPlan.state_of(self.tensors, self.watch)


def kept_kernel_weights(owner: nn.Module,
                        read: Callable[[], list[LayerKernelWeights | None]]) -> list[LayerKernelWeights] | None:
    """`read()` (every layer's kernel weights), kept on `owner` until its `KernelPlan` is stale:
    reading them checks every module (~60 for the target, ~0.5 ms), checking the plan ~10 us.
    None while any of the owner's parameters takes gradients: the kernels have no backward."""
    plan = owner.__dict__.get("_kernel_plan")
    if plan is None or plan.stale():
        tensors = list(owner.parameters())
        kernels = cpu_kernels.kernels()
        watch = kernels.ParameterWatch(tensors) if kernels is not None else None
        state = KernelPlan.state_of(tensors, watch)  # before reading: a change meanwhile makes the plan stale
        weights = None if any(t.requires_grad for t in tensors) else read()
        plan = owner.__dict__["_kernel_plan"] = KernelPlan(
            None if weights is None or None in weights else weights, tensors, state, watch)  # type: ignore[arg-type]
    return plan.weights


def kept_layer_stack(owner: nn.Module) -> object:
    """The owner's kept kernel weights (`kept_kernel_weights`, just read) as the kernels'
    `LayerStack` (what `stack_forward` and `context_kv` take), built once per plan."""
    plan = owner.__dict__["_kernel_plan"]
    if not plan.stack:
        cfg = owner.config  # type: ignore[union-attr]
        plan.stack.append(cpu_kernels.kernels().LayerStack(  # type: ignore[union-attr]
            [tuple(w[:10]) for w in plan.weights], cfg.num_attention_heads, cfg.head_dim ** -0.5))
    return plan.stack[0]


def greedy_chain_call(stack: object, tokens: list[int], hidden: Tensor | None, steps: int, cache: KVCache,
                      embedding: Tensor, rotary: "Rotary", norm_weight: Tensor, eps: float, head: TiledWeight,
                      embedded_norm: Tensor | None, vocab_limit: int,
                      vocab: list[int] | None) -> tuple[list[int], list[float], Tensor | None]:
    """`steps` greedy chain steps from the cache's next position (row 0) in one kernel call
    (`cpu_kernels.chain_steps`; docs/design.md, "Greedy chains in one call"): the first feeds
    `tokens`, each later one the token just drafted; a step picks as a drafter's greedy `picks`
    does (the first `vocab_limit` columns of the head's logits, or the draft vocabulary
    `vocab`'s ids). (tokens, probabilities, the last output with `hidden`); the caller advances
    the cache."""
    rows = head.weight.shape[0]
    cos, signed_sin = rotary.tables(cache.length + len(tokens) + steps - 1, torch.float32)
    return cpu_kernels.kernels().chain_steps(  # type: ignore[union-attr]
        stack, tokens, hidden, cache.length, steps, embedding, cos, signed_sin, cache.keys, cache.values, norm_weight,
        eps, head.tiles, rows, embedded_norm, rows if vocab is not None else min(vocab_limit, rows), vocab or [])


def key_ends(ragged: Ragged, block_size: int | None, read_end: int, context_ends: list[int] | None) -> Tensor:
    """Where each packed token's keys end (`attention_mask`'s keys as a range): after its own
    position (causal) or at the end of its block and the forward's read end (block diffusion),
    and at most at its row's context end."""
    positions = ragged.positions[0]
    ends = positions + 1 if block_size is None else ((positions // block_size + 1) * block_size).clamp(max=read_end)
    if context_ends is not None:
        ends = torch.minimum(ends, torch.tensor(context_ends, device=ends.device)[ragged.row_of])
    return ends


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None,
                cache: KVCache | None, layer: int, start: int | Ragged, context_end: int | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, layer, start, context_end)
        return x + self.mlp(self.post_attention_layernorm(x))

    def kernel_weights(self) -> LayerKernelWeights | None:
        """The layer's weights for the one-call kernel (`layer_kernel_weights`)."""
        return layer_kernel_weights(self, self.input_layernorm)


def kernel_forward_fits(config: ModelConfig, cache: KVCache, rows: int) -> bool:
    """Whether a forward of `rows` tokens over `cache` may run one kernel call per layer: a
    float32 cache, at most MAX_ROWS rows (MKL's product is faster past them) and heads no wider
    than the attention kernel's 128."""
    return rows <= MAX_ROWS and config.head_dim <= 128 and cache.keys[0].dtype == torch.float32


def kernel_layer_weights(owner: nn.Module, layers: Sequence[nn.Module], rows: int,
                         cache: KVCache) -> list[LayerKernelWeights] | None:
    """The weights of `layers` (each with a `kernel_weights()`) of model `owner` for one kernel
    call per layer in a forward of `rows` tokens over `cache` (docs/design.md, "One call per
    layer"), or None where the layers run op by op: not float32 inference with the CPU
    kernels, more than MAX_ROWS rows (MKL's product is faster there) or heads wider than the
    attention kernel's 128 (`kernel_forward_fits`). Kept until a packed copy anywhere is set or
    dropped, or a parameter changes in place or starts to train (`kept_kernel_weights`)."""
    if not kernel_forward_fits(owner.config, cache, rows):  # type: ignore[arg-type]
        return None
    return kept_kernel_weights(owner, lambda: [layer.kernel_weights() for layer in layers])


def layer_kernel_weights(layer: nn.Module, input_norm: RMSNorm,
                         embedded_norm: RMSNorm | None = None) -> LayerKernelWeights | None:
    """A decoder layer's tiled float32 weights for the one-call kernel (docs/design.md, "One
    call per layer"), its attention input normed by `input_norm` (beside the embedding normed
    by `embedded_norm`: an EAGLE-3 layer); None where it runs op by op: its products are not
    all tiled (no kernels, another dtype, int8), a weight trains, or one changed since it was
    tiled."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = attn.fused(), mlp.fused()
    o, down = (part.fresh_packed() if isinstance(part, Linear) else None for part in (attn.o_proj, mlp.down_proj))
    if not (isinstance(qkv, Product) and isinstance(qkv.weight, TiledWeight) and isinstance(gate_up, Product)
            and isinstance(gate_up.weight, TiledWeight) and gate_up.bias is None
            and isinstance(o, TiledWeight) and isinstance(down, TiledWeight)
            and attn.o_proj.bias is None and mlp.down_proj.bias is None):
        return None
    norms = [input_norm, layer.post_attention_layernorm, getattr(attn, "q_norm", None), getattr(attn, "k_norm", None),
             embedded_norm]
    if any(n is not None and (n.weight.dtype != torch.float32 or n.weight.requires_grad or n.eps != input_norm.eps)
           for n in norms):  # the kernel takes one eps
        return None
    return LayerKernelWeights(input_norm.weight, qkv.weight.tiles, qkv.bias, *(n and n.weight for n in norms[2:4]),
                              o.tiles, layer.post_attention_layernorm.weight, gate_up.weight.tiles, down.tiles,
                              input_norm.eps, embedded_norm and embedded_norm.weight)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Decoder-only LM; `forward` serves inference over a cache, `hidden_masked` training."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity,
                       self.dtype, self.device, batch)

    def _hidden(self, tokens: Tensor, positions: Tensor | slice, mask: Tensor | None,
                cache: KVCache | None, start: int | Ragged, context_end: int | None = None,
                taps: Sequence[int] = (), kernel_layers: "KernelLayers | None" = None) -> tuple[Tensor, Tensor | None]:
        """Final (normed) hidden states, and the outputs of layers `taps` concatenated on the
        last dimension in layer order (None without taps): what a target-conditioned drafter reads.
        With `kernel_layers` each layer is one kernel call (`_kernel_layers`; mask unused)."""
        x = self.model.embed_tokens(tokens)
        # a forward over a cache reads kept tables (a slice of positions: views); a training forward builds its own
        rope = self.rotary(positions, x.dtype) if cache is None else self.rotary.rows(positions, x.dtype)
        tapped = []
        for i, layer in enumerate(self.model.layers):
            if kernel_layers is None:
                x = layer(x, rope, mask, cache, i, start, context_end)
            else:
                x = kernel_layers.run(i, x, rope, cache, start)  # type: ignore[arg-type]
            if i in taps:
                tapped.append(x)
        return self.model.norm(x), torch.cat(tapped, dim=-1) if tapped else None

    def forward(self, tokens: Tensor, start: int, cache: KVCache, *, block_size: int | None = None,
                commit: bool = True, logits_at: slice | list[int] | None = None,
                context_end: int | None = None, head_weight: Tensor | TiledWeight | None = None,
                taps: Sequence[int] = ()) -> Tensor | tuple[Tensor, Tensor]:
        """Logits for `tokens` [B, T] at positions start..start+T-1, attending to the cache.

        The cache must hold exactly positions [0, start). With `commit` the new K/V count as
        cached afterwards; without it they are scratch (a diffusion denoising pass).
        `logits_at` selects the positions (indices into T) that need logits: the output head
        is the costliest layer of a small model, so drafters ask only for what they read.
        `head_weight` [V', hidden] replaces the output head's rows (a drafter's reduced
        vocabulary: logits over V' tokens).

        A scratch pass may also start past `cache.length` and attend up to `context_end`:
        positions [cache.length, context_end) outside its own tokens then contribute the
        scratch K/V an earlier pass wrote there (the block cache of a sub-block pass).

        With `taps` (layer indices, ascending) the result is (logits, features [B, T, F]): the
        tapped layers' outputs at every token (docs/design.md, "Target-conditioned drafting").
        """
        t = tokens.shape[1]
        if start != cache.length and (commit or context_end is None or start < cache.length):
            raise ValueError(f"forward at position {start} but the cache holds {cache.length}")
        end = max(start + t, context_end or 0)
        if end > cache.capacity:
            raise ValueError(f"positions up to {end} exceed the cache capacity {cache.capacity}")
        kernel_layers = None
        if (weights := self._kernel_layers(tokens.numel(), cache)) is not None:
            b = tokens.shape[0]
            picked = range(t)[logits_at] if isinstance(logits_at, slice) else range(t) if logits_at is None else [
                range(t)[j] for j in logits_at]  # range's indexing: negative indices count back, others raise
            rows = [i * t + j for i in range(b) for j in picked]
            if (whole := self._whole_forward(tokens, None, start, end, block_size or 0, cache, rows, head_weight,
                                             taps)) is not None:
                if commit:
                    cache.length = start + t
                logits = whole[0].view(b, len(picked), whole[0].shape[-1])
                return (logits, whole[1].view(b, t, -1)) if taps else logits
            kernel_layers = KernelLayers(weights, self.config.num_attention_heads, self.config.head_dim ** -0.5,
                                         end, block_size or 0)
        mask = None
        if kernel_layers is None and (t > 1 or block_size is not None or end > start + t):
            mask = attention_mask(torch.arange(start, start + t, device=tokens.device),
                                  torch.arange(end, device=tokens.device), block_size)
        hidden, features = self._hidden(tokens, slice(start, start + t), mask, cache, start, context_end, taps,
                                        kernel_layers)
        logits = self._head(hidden if logits_at is None else hidden[:, logits_at], head_weight)
        if commit:
            cache.length = start + t
        return logits if features is None else (logits, features)

    def _kernel_layers(self, rows: int, cache: KVCache) -> list[LayerKernelWeights] | None:
        """Every layer's weights for one kernel call per layer in a forward of `rows` tokens over
        `cache` (`kernel_layer_weights`)."""
        return kernel_layer_weights(self, self.model.layers, rows, cache)

    def _whole_forward(self, tokens: Tensor, places: Tensor | None, start: int, read_end: int, block_size: int,
                       cache: KVCache, rows: list[int], head_weight: Tensor | TiledWeight | None,
                       taps: Sequence[int]) -> list[Tensor] | None:
        """[logits [len(rows), V] of the forward's tokens `rows` (flat indices), the tapped
        layers' outputs [N, F]] in one kernel call (`cpu_kernels.stack_forward`: embedding, every
        layer, final norm and head; docs/design.md, "One call per forward"), the same bits as
        one kernel call per layer, with the layer weights `_kernel_layers` has just kept; None
        where that call does not serve (an untiled head, an embedding or norm not in float32)."""
        if (parts := self._whole_parts()) is None:
            return None
        stack, embedding, norm, eps, default_head = parts
        head = default_head if head_weight is None else head_weight
        if not isinstance(head, TiledWeight) or len(rows) > MAX_ROWS:
            return None
        cos, signed_sin = self.rotary.tables(read_end, torch.float32)
        return cpu_kernels.kernels().stack_forward(  # type: ignore[union-attr]
            stack, tokens.reshape(-1).tolist(), tokens.shape[0], places, start, read_end, block_size, embedding, cos,
            signed_sin, cache.keys, cache.values, norm, eps, head.tiles, head.weight.shape[0], rows, list(taps))

    def _whole_parts(self) -> tuple | None:
        """(LayerStack, embedding, final norm weight and eps, the tiled head or None) for
        `_whole_forward`, read once per kept plan (`_kernel_layers` has just kept it): the
        module attributes and checks took ~100 us a forward on flushed caches. None where the
        embedding or the norm is not float32."""
        plan = self.__dict__["_kernel_plan"]
        if not plan.parts:
            embedding, norm, head = self.model.embed_tokens.weight, self.model.norm, self.lm_head.fresh_packed()
            fits = embedding.dtype == norm.weight.dtype == torch.float32 and embedding.is_contiguous()
            default_head = head if isinstance(head, TiledWeight) and self.lm_head.bias is None else None
            plan.parts.append((kept_layer_stack(self), embedding, norm.weight, norm.eps, default_head) if fits else None)
        return plan.parts[0]

    def greedy_chain(self, tokens: list[int], steps: int, cache: KVCache, head_weight: Tensor | TiledWeight | None,
                     vocab_limit: int, vocab: list[int] | None) -> tuple[list[int], list[float]] | None:
        """`steps` greedy steps of an AR drafter in one kernel call (`greedy_chain_call`): the
        first forward feeds `tokens` at the cache's next positions, each later one the token
        just drafted, each picking from its last row's logits; the same bits as `forward` and a
        greedy pick step by step. None where `_whole_forward` would not serve or the steps would
        pass the cache's end."""
        n = len(tokens)
        if cache.length + n + steps - 1 > cache.capacity or self._kernel_layers(n, cache) is None or (
                parts := self._whole_parts()) is None:
            return None
        stack, embedding, norm_weight, eps, default_head = parts
        head = default_head if head_weight is None else head_weight
        if not isinstance(head, TiledWeight):
            return None
        drafted, confs, _ = greedy_chain_call(stack, tokens, None, steps, cache, embedding, self.rotary, norm_weight,
                                              eps, head, None, vocab_limit, vocab)
        return drafted, confs

    def _head(self, hidden: Tensor, head_weight: Tensor | TiledWeight | None) -> Tensor:
        return self.lm_head(hidden) if head_weight is None else linear(hidden, head_weight)

    def forward_ragged(self, ragged: Ragged, cache: KVCache, *, block_size: int | None = None,
                       context_ends: list[int] | None = None, logits_at: Tensor | None = None,
                       head_weight: Tensor | TiledWeight | None = None,
                       taps: Sequence[int] = ()) -> Tensor | tuple[Tensor, Tensor]:
        """Logits [N, V] for the packed tokens of several cache rows in one forward (a batch's
        verification or drafting step), or for the packed indices `logits_at` only; with
        `taps`, also the tapped layers' features [N, F] (as `forward`).

        Row i's cache row must hold its positions [0, starts[i]); its tokens' K/V are written
        at their positions, and cache lengths are the caller's (`KVCache.row` views). A
        bucketed `ragged` (filler rows included, `Ragged.pack`) also reads keys up to a bucket. Causal;
        or, with `block_size`, block-causal up to `context_ends[i]` (scratch passes of a
        block-diffusion drafter, which read K/V earlier passes wrote up there).
        """
        device = ragged.tokens.device
        read_end = max([s + n for s, n in zip(ragged.starts, ragged.lengths)] + (context_ends or []))
        if read_end > cache.capacity:
            raise ValueError(f"positions up to {read_end} exceed the cache capacity {cache.capacity}")
        if ragged.bucketed:  # a padded causal forward (a verification): keys read up to a bucket too
            if block_size is not None:
                raise ValueError("padded ragged forwards are causal: filler K/V in a block would be read")
            read_end = key_bucket(read_end, cache.capacity)
        allowed = kernel_layers = None
        if (weights := self._kernel_layers(ragged.tokens.numel(), cache)) is not None:
            places = torch.stack([ragged.cache_row_of, ragged.positions[0], key_ends(ragged, block_size, read_end,
                                                                                      context_ends)])
            every = range(ragged.tokens.numel())
            rows = list(every) if logits_at is None else [every[j] for j in logits_at.tolist()]
            if (whole := self._whole_forward(ragged.tokens, places, 0, read_end, 0, cache, rows, head_weight,
                                             taps)) is not None:
                return (whole[0], whole[1]) if taps else whole[0]
            kernel_layers = KernelLayers(weights, self.config.num_attention_heads, self.config.head_dim ** -0.5,
                                         places=places)
        else:
            keys = torch.arange(read_end, device=device)
            allowed = attention_mask(ragged.padded_positions(), keys, block_size)
            if context_ends is not None:
                allowed &= keys < torch.tensor(context_ends, device=device)[:, None, None]
            allowed = allowed[:, None]
        hidden, features = self._hidden(ragged.tokens, ragged.positions[0], allowed, cache, ragged, read_end,
                                        taps, kernel_layers)
        logits = self._head(hidden[0] if logits_at is None else hidden[0, logits_at], head_weight)
        return logits if features is None else (logits, features[0])

    def features(self, tokens: Tensor, taps: Sequence[int]) -> Tensor:
        """Tapped layers' outputs [B, T, F] of a cache-free causal forward over tokens [B, T]
        (what a DFlash drafter trains on)."""
        return self.tapped(tokens, taps)[1]

    def tapped(self, tokens: Tensor, taps: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Final (normed) hidden states [B, T, hidden] and tapped layers' outputs [B, T, F] of
        one cache-free causal forward: a drafter's inputs and its soft labels in one pass."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        final, tapped = self._hidden(tokens, pos, attention_mask(pos, pos, None), None, 0, taps=taps)
        assert tapped is not None, "tapped() needs at least one layer to tap"
        return final, tapped

    def hidden_masked(self, tokens: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """Final hidden states of a cache-free forward with an explicit [T, T] attention mask.

        Training uses it so that the output head runs only on positions that carry a loss.
        """
        return self._hidden(tokens, positions, mask, None, 0)[0]
