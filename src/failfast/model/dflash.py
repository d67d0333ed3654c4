"""A DFlash-style block drafter (z-lab's `DFlashDraftModel` layout): a few decoder layers
that read the target's features as extra keys and values (docs/design.md,
"Target-conditioned drafting").

The drafter has no embedding or output head of its own: it uses the target's. Target
features (the outputs of layers `target_layer_ids`, concatenated) are fused once (`fc`,
then `hidden_norm`) and every drafter layer projects them with its own key/value
projections; those context K/V live in a KVCache at the target positions they describe.
A drafting pass runs the block `[known tokens..., masks...]` non-causally against that
context and its own K/V; the hidden state at a masked position predicts that position's
token (no token shift).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from failfast.errors import IncompatibleModelsError
from failfast.model.borrowed import BorrowsTargetParts, packed_places
from failfast.model.config import ModelConfig
from failfast.model.kv_cache import KVCache
from failfast.model import cpu_kernels
from failfast.model.tiled import TiledWeight
from failfast.model.transformer import (DecoderLayer, KernelLayers, LayerKernelWeights, Linear, RMSNorm, Rotary,
                                        kept_layer_stack, kernel_layer_weights)


class DFlashLayer(DecoderLayer):
    """A Qwen3 decoder layer whose attention also reads context keys/values: a decoder layer's
    weights (and kernel weights) with another forward."""

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], context_k: Tensor,  # type: ignore[override]
                context_v: Tensor, mask: Tensor | None) -> Tensor:
        """x [B, W, hidden]; context K/V [B, kv_heads, C, head_dim]; `mask` [B, 1, W, C + W]
        (True: may attend) or None (every query sees every key)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q, k, v = attn.queries_keys_values(h, rope)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=attn.n_kv != attn.n_heads)
        b, w, _ = x.shape
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, w, attn.n_heads * attn.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(BorrowsTargetParts):
    """The drafter's own weights (`fc`, `hidden_norm`, `layers.N.*`, `norm`); the target's
    embedding and output head are attached by `attach` and never saved with it."""

    kind = "DFlash"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not cfg.is_dflash:
            raise IncompatibleModelsError("a DFlash model needs target_layer_ids in its config")
        self.config = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity, self.dtype, self.device, batch)

    def fuse(self, features: Tensor) -> Tensor:
        """Target features [..., len(target_layer_ids) * hidden] -> fused context [..., hidden]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, fused: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's context keys/values [B, kv_heads, T, head_dim] for fused context
        [B, T, hidden] at positions [T]."""
        rope = self.rotary(positions, fused.dtype)
        return [layer.self_attn.keys_values(fused, rope) for layer in self.layers]

    def write_context(self, features: Tensor, start: int, cache: KVCache) -> None:
        """Cache the context K/V of target features [1, T, F] at positions start..start+T-1
        (the cache must hold exactly [0, start)); one kernel call where the layers run on the
        kernels (`context_kv`: each layer's keys and values from its fused q/k/v product, so
        they round unlike the separate projections, which only changes what is proposed)."""
        if start != cache.length:
            raise ValueError(f"context at position {start} but the drafter cache holds {cache.length}")
        t = features.shape[1]
        fc = self.fc.fresh_packed()
        if (isinstance(fc, TiledWeight) and features.shape[0] == 1 and start + t <= cache.capacity
                and self.hidden_norm.weight.dtype == torch.float32
                and self._kernel_weights(cache, t) is not None):  # one kernel call
            cos, signed_sin = self.rotary.tables(start + t, torch.float32)
            cpu_kernels.kernels().context_kv(  # type: ignore[union-attr]
                kept_layer_stack(self), features[0].to(self.dtype).contiguous(), fc.tiles,
                self.hidden_norm.weight, self.hidden_norm.eps, cos, signed_sin, cache.keys, cache.values, start)
        else:
            positions = torch.arange(start, start + t, device=features.device)
            for i, (k, v) in enumerate(self.context_kv(self.fuse(features.to(self.dtype)), positions)):
                cache.write(i, start, k, v)
        cache.length = start + t

    def hidden(self, tokens: Tensor, positions: Tensor, context: list[tuple[Tensor, Tensor]],
               mask: Tensor | None) -> Tensor:
        """Final hidden states [B, W, hidden] of block tokens [B, W] at `positions` ([W], or
        [B, W] when rows differ, as in training) against every layer's context K/V."""
        x = self.embed_tokens(tokens).to(self.dtype)
        rope = self.rotary(positions, x.dtype)
        if positions.dim() == 2:  # per-row tables broadcast over the heads
            rope = (rope[0][:, None], rope[1][:, None])
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, rope, k, v, mask)
        return self.norm(x)

    def draft_pass(self, tokens: Tensor, start: int, cache: KVCache) -> Tensor:
        """Final hidden states [1, W, hidden] of a block at positions start.. against the cached
        context [0, start); the block's own K/V are not kept (the kernel path writes them at
        positions start.. as scratch, where the cache has room; the length does not move)."""
        if start != cache.length:
            raise ValueError(f"a block at position {start} but the drafter cache holds {cache.length}")
        width = tokens.shape[1]
        if start + width <= cache.capacity and (weights := self._kernel_weights(cache, width)) is not None:
            return self._kernel_hidden(weights, tokens[0], [0], [start], [width], cache)[None]
        positions = torch.arange(start, start + width, device=tokens.device)
        context = [(cache.keys[i][:, :, :start], cache.values[i][:, :, :start]) for i in range(len(self.layers))]
        return self.hidden(tokens, positions, context, None)

    def draft_passes(self, windows: list[list[int]], rows: list[int], starts: list[int], cache: KVCache) -> list[Tensor]:
        """Several rows' blocks in one forward: row i's block `windows[i]` at positions
        starts[i].. against the context [0, starts[i]) of cache row rows[i] (starts[i]: the
        row's cached length); each row's final hidden states [len(windows[i]), hidden] (packed
        for the kernels, which write each block's K/V at its positions as scratch; else padded
        to the longest and masked out)."""
        device = self.device
        lengths = [len(w) for w in windows]
        if (max(s + n for s, n in zip(starts, lengths)) <= cache.capacity
                and (weights := self._kernel_weights(cache, sum(lengths))) is not None):
            tokens = torch.tensor([t for w in windows for t in w], device=device)
            return list(self._kernel_hidden(weights, tokens, rows, starts, lengths, cache).split(lengths))
        width, context_len = max(lengths), max(starts)
        tokens = torch.tensor([w + w[-1:] * (width - len(w)) for w in windows], device=device)
        start = torch.tensor(starts, device=device)[:, None]
        index = torch.tensor(rows, device=device)
        context = [(cache.keys[i][index, :, :context_len], cache.values[i][index, :, :context_len])
                   for i in range(len(self.layers))]
        sees_context = torch.arange(context_len, device=device)[None, :] < start
        sees_block = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        mask = torch.cat([sees_context, sees_block], dim=1)[:, None, None, :].expand(-1, 1, width, -1)
        hidden = self.hidden(tokens, start + torch.arange(width, device=device), context, mask)
        return [hidden[i, :len(w)] for i, w in enumerate(windows)]

    def pass_logits(self, windows: list[list[int]], rows: list[int], starts: list[int], cache: KVCache,
                    masks: list[int], head_weight: TiledWeight | Tensor | None = None) -> list[Tensor] | None:
        """`draft_passes` and the head (the target's, or `head_weight`: a draft vocabulary's
        rows) at each block's last `masks[i]` positions, in one kernel call
        (`cpu_kernels.stack_forward` over the packed blocks, as `_kernel_hidden` places them:
        embedding, layers, norm and head, the same bits as those calls one by one): each row's
        logits [masks[i], V']. None where that call does not serve (the caller runs the passes
        and the head itself)."""
        lengths = [len(w) for w in windows]
        ends = [s + n for s, n in zip(starts, lengths)]
        if (max(ends) > cache.capacity or (parts := self.whole_call_parts(head_weight)) is None
                or self._kernel_weights(cache, sum(lengths)) is None):
            return None
        picked, offset = [], 0
        for n, m in zip(lengths, masks):
            picked += range(offset + n - m, offset + n)
            offset += n
        logits, _ = self.whole_call(parts, [t for w in windows for t in w],
                                    packed_places(rows, starts, lengths, self.device), max(ends), cache, picked)
        return list(logits.split(masks))

    def _kernel_weights(self, cache: KVCache, rows: int) -> list[LayerKernelWeights] | None:
        """The layers' weights for one kernel call per layer (float32 inference with the CPU
        kernels; `kernel_layer_weights`), else None."""
        return kernel_layer_weights(self, self.layers, rows, cache)

    def _kernel_hidden(self, weights: list[LayerKernelWeights], tokens: Tensor, rows: list[int], starts: list[int],
                       lengths: list[int], cache: KVCache) -> Tensor:
        """Final hidden states [N, hidden] of packed blocks (tokens [N]: row i's `lengths[i]`
        tokens at positions starts[i].. of cache row rows[i]), one kernel call per layer
        (docs/design.md, "One call per layer"). Each token's K/V are written at its position,
        past the row's context (scratch: cache lengths do not move), and its query reads keys
        up to its block's end: the context, then the whole block, as the op-by-op pass does
        (the attention kernel rounds unlike SDPA, which only changes what is proposed)."""
        places = packed_places(rows, starts, lengths, tokens.device)
        cfg = self.config
        layers = KernelLayers(weights, cfg.num_attention_heads, cfg.head_dim ** -0.5, places=places)
        x = self.embed_tokens(tokens).to(self.dtype)[None]
        rope = self.rotary.rows(places[1], x.dtype)
        for i in range(len(weights)):
            x = layers.run(i, x, rope, cache, 0)
        return self.norm(x)[0]
