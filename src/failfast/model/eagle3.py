"""An EAGLE-3-style chain drafter: one decoder layer over the target's fused features
(docs/design.md, "EAGLE-3").

Target features (the outputs of layers `target_layer_ids`, concatenated) are fused by `fc`
into a hidden-size vector g_j per position j. The layer's input at slot j is the pair
(g_j, embedding of token j+1), side by side (2 x hidden wide into q/k/v), and its output
h_j predicts token j+2 through the target's final head. Drafting continues the chain on its
own outputs: the next slot reads (h_j, embedding of the token just drafted). The residual
stream is the feature (or the previous output), so h_j lives where target features live.
Slots of committed positions, built from true target features, are cached as K/V; a
round's draft slots are written after them and rolled back like any KV cache.
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
from failfast.model.transformer import (MLP, Attention, LayerKernelWeights, Linear, RMSNorm, Rotary, greedy_chain_call,
                                        kept_layer_stack, kernel_layer_args, kernel_layer_weights, layer_kernel_weights, linear)


class Eagle3Layer(nn.Module):
    """A Qwen3-style decoder layer whose attention reads [normed embedding, normed hidden]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)      # on the feature / previous output
        self.self_attn = Attention(cfg, in_features=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention_input(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        return torch.cat([self.input_layernorm(embedded), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: Tensor, attended: Tensor) -> Tensor:
        """The layer's output from its residual input and attention output [B, T, heads*dim]."""
        x = hidden + self.self_attn.o_proj(attended)
        return x + self.mlp(self.post_attention_layernorm(x))

    def kernel_weights(self) -> LayerKernelWeights | None:
        """The weights for the one-call kernel (docs/design.md, "One call per layer"): the
        hidden norm is its input norm, the embedding's norm comes beside it."""
        return layer_kernel_weights(self, self.hidden_norm, embedded_norm=self.input_layernorm)


class Eagle3Model(BorrowsTargetParts):
    """The drafter's own weights (`fc`, `midlayer.*`, `norm`); the target's embedding and
    output head are attached by `attach` and never saved with it."""

    kind = "EAGLE-3"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not cfg.is_eagle3:
            raise IncompatibleModelsError("an EAGLE-3 model needs eagle_config target layer ids in its config")
        self.config = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        c = self.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, capacity, self.dtype, self.device, batch)

    def fuse(self, features: Tensor) -> Tensor:
        """Target features [..., len(target_layer_ids) * hidden] -> g [..., hidden]."""
        return self.fc(features.to(self.dtype))

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, signed_sin = self.rotary(positions, dtype)
        if positions.dim() == 2:  # per-row tables broadcast over the heads
            return cos[:, None], signed_sin[:, None]
        return cos, signed_sin

    def slot_kv(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of slots (hidden [B, T, hidden], next tokens [B, T])."""
        x = self.midlayer.attention_input(self.embed_tokens(tokens).to(self.dtype), hidden)
        return self.midlayer.self_attn.keys_values(x, self._rope(positions, x.dtype))

    def write_context(self, tokens: Tensor, fused: Tensor, start: int, cache: KVCache) -> None:
        """Cache the K/V of committed slots start.. (fused features [1, T, hidden], their next
        tokens [1, T]); the cache must hold exactly [0, start). One kernel call where the layer
        runs on the kernels (`cpu_kernels.slot_kv`: keys and values from the fused q/k/v
        product, so they round unlike the separate projections, which only changes what is
        proposed)."""
        if start != cache.length:
            raise ValueError(f"slots from {start} but the drafter cache holds {cache.length}")
        t, embedding = tokens.shape[1], self.embed_tokens.weight
        if (fused.shape[0] == 1 == cache.keys[0].shape[0] and start + t <= cache.capacity and embedding.dtype == fused.dtype == torch.float32
                and embedding.is_contiguous() and not (torch.is_grad_enabled() and fused.requires_grad)
                and (w := self._kernel_weights(cache, t)) is not None):
            cos, signed_sin = self.rotary.tables(start + t, torch.float32)
            cpu_kernels.kernels().slot_kv(  # type: ignore[union-attr]
                kept_layer_stack(self), tokens[0].tolist(), fused[0].contiguous(), embedding, w.embedded_norm, cos,
                signed_sin, cache.keys[0], cache.values[0], start)
        else:
            k, v = self.slot_kv(tokens, fused, torch.arange(start, start + t, device=tokens.device))
            cache.write(0, start, k, v)
        cache.length = start + t

    def step(self, tokens: Tensor, hidden: Tensor, cache: KVCache) -> Tensor:
        """One drafting step of a one-row cache: the slot (hidden [1, 1, hidden], next token
        [1, 1]) at the cache's end (`step_rows`); its K/V are appended."""
        out = self.step_rows(tokens, hidden, [0], [cache.length], cache)
        cache.length += 1
        return out

    def step_rows(self, tokens: Tensor, hidden: Tensor, rows: list[int], starts: list[int], cache: KVCache) -> Tensor:
        """One drafting step for several cache rows at once: row i's slot (hidden [i, 0], next
        token tokens [i, 0]) at position starts[i] of cache row rows[i] writes its K/V there and
        attends to that row's slots [0, starts[i]]. Returns the outputs [B, 1, hidden] (each
        the next step's hidden; `logits_input` for its prediction); lengths are the caller's."""
        device = tokens.device
        attn = self.midlayer.self_attn
        embedded = self.embed_tokens(tokens).to(self.dtype)
        if not (torch.is_grad_enabled() and hidden.requires_grad) and (
                weights := self._kernel_weights(cache, len(rows))) is not None:
            return self._kernel_step(weights, embedded, hidden, rows, starts, cache)
        x = self.midlayer.attention_input(embedded, hidden)
        position = torch.tensor(starts, device=device)[:, None]
        q, k, v = attn.queries_keys_values(x, self._rope(position, x.dtype))
        if len(rows) == 1:  # one row: write and read its cache row in place, no gathered copy
            keys, values = cache.row(rows[0]).write(0, starts[0], k, v)
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=attn.n_kv != attn.n_heads)
        else:
            index = torch.tensor(rows, device=device)
            cache.keys[0][index, :, position[:, 0]] = k[:, :, 0]
            cache.values[0][index, :, position[:, 0]] = v[:, :, 0]
            width = max(starts) + 1
            sees = (torch.arange(width, device=device)[None, :] <= position)[:, None, None, :]
            out = F.scaled_dot_product_attention(q, cache.keys[0][index, :, :width], cache.values[0][index, :, :width],
                                                 attn_mask=sees, enable_gqa=attn.n_kv != attn.n_heads)
        return self.midlayer.finish(hidden, out.transpose(1, 2).reshape(len(rows), 1, -1))

    def _kernel_weights(self, cache: KVCache, rows: int) -> LayerKernelWeights | None:
        """The layer's weights for one kernel call per step (float32 inference with the CPU
        kernels), kept like a target's (`kernel_layer_weights`), else None."""
        weights = kernel_layer_weights(self, [self.midlayer], rows, cache)
        return None if weights is None else weights[0]

    def _kernel_step(self, w: LayerKernelWeights, embedded: Tensor, hidden: Tensor, rows: list[int],
                     starts: list[int], cache: KVCache) -> Tensor:
        """`step_rows` in one kernel call: each row's slot is a packed token at its cache row
        and position, attending to keys up to it (the same arithmetic; the attention kernel
        rounds unlike SDPA, which only changes what is proposed)."""
        b, attn = len(rows), self.midlayer.self_attn
        places = packed_places(rows, starts, [1] * b, hidden.device)
        args = kernel_layer_args(w, hidden.reshape(1, b, -1), self.rotary.rows(places[1], hidden.dtype), cache, 0)
        out = cpu_kernels.kernels().packed_decoder_layer(  # type: ignore[union-attr]
            *args, places, attn.n_heads, attn.head_dim ** -0.5, embedded=embedded.reshape(1, b, -1).contiguous(),
            embedded_norm=w.embedded_norm)
        return out.view(b, 1, -1)

    def step_logits(self, tokens: Tensor, hidden: Tensor, rows: list[int], starts: list[int], cache: KVCache,
                    head_weight: TiledWeight | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`step_rows` and the logits each output predicts [B, V'] (through the target's head,
        or `head_weight`: a draft vocabulary's rows). Where the layer takes one kernel call and
        the head is tiled, the whole step is one call (`cpu_kernels.stack_forward` with the
        outputs as the residual input, its one layer's output tapped): embedding, layer, norm
        and head, the same bits as those calls one by one (docs/design.md, "One call per
        forward")."""
        if (whole := self._whole_step(tokens, hidden, rows, starts, cache, head_weight)) is not None:
            return whole
        out = self.step_rows(tokens, hidden, rows, starts, cache)
        h = self.logits_input(out)[:, -1]
        return out, self.lm_head(h) if head_weight is None else linear(h, head_weight)

    def _whole_call_inputs(self, hidden: Tensor, cache: KVCache, rows: int,
                           head_weight: TiledWeight | Tensor | None) -> tuple[tuple, LayerKernelWeights] | None:
        """(`whole_call_parts`, the kept layer weights) for steps of `rows` rows in one kernel
        call, or None where that call does not serve (gradients, not float32, no kernels)."""
        if (torch.is_grad_enabled() and hidden.requires_grad) or hidden.dtype != torch.float32 or (
                parts := self.whole_call_parts(head_weight)) is None or (
                w := self._kernel_weights(cache, rows)) is None:
            return None
        return parts, w

    def _whole_step(self, tokens: Tensor, hidden: Tensor, rows: list[int], starts: list[int], cache: KVCache,
                    head_weight: TiledWeight | Tensor | None) -> tuple[Tensor, Tensor] | None:
        if (found := self._whole_call_inputs(hidden, cache, len(rows), head_weight)) is None:
            return None
        parts, w = found
        b = len(rows)
        logits, out = self.whole_call(parts, tokens.reshape(-1).tolist(),
                                      packed_places(rows, starts, [1] * b, hidden.device), max(starts) + 1, cache,
                                      list(range(b)), [0], hidden=hidden.reshape(b, -1).contiguous(),
                                      embedded_norm=w.embedded_norm)
        return out.view(b, 1, -1), logits

    def greedy_chain(self, token: int, hidden: Tensor, steps: int, cache: KVCache,
                     head_weight: TiledWeight | Tensor | None, vocab_limit: int,
                     vocab: list[int] | None) -> tuple[list[int], list[float], Tensor] | None:
        """`steps` chain steps from the cache's next slot (row 0) in one kernel call
        (`greedy_chain_call`): each step's output [1, 1, hidden] and the greedy pick of
        its logits (the first `vocab_limit` columns, or through the draft vocabulary `vocab`)
        feed the next, as `step_logits` and a drafter's greedy `picks` would one step at a
        time, with the same bits. The tokens, their probabilities and the last output; the
        caller advances the cache. None where `_whole_step` would not serve, or the steps would
        pass the cache's end."""
        if cache.length + steps > cache.capacity or (
                found := self._whole_call_inputs(hidden, cache, 1, head_weight)) is None:
            return None
        (embedding, head), w = found
        tokens, confs, out = greedy_chain_call(kept_layer_stack(self), [token], hidden.reshape(1, -1).contiguous(),
                                               steps, cache, embedding, self.rotary, self.norm.weight, self.norm.eps,
                                               head, w.embedded_norm, vocab_limit, vocab)
        return tokens, confs, out.view(1, 1, -1)

    def logits_input(self, output: Tensor) -> Tensor:
        """What the target's head reads: the normed layer output."""
        return self.norm(output)

    def unrolled(self, tokens: Tensor, fused: Tensor, steps: int) -> list[Tensor]:
        """Training-time test: the chain run `steps` times over every slot of rows tokens
        [B, L] with fused features [B, L, hidden]; step s reads, at slot j, the output of step
        s-1 at slot j-1 (what drafting feeds back) and attends as drafting's s-th step does:
        to true slots <= j-s and to step k's slot j-s+k for k = 1..s. Returns each step's
        outputs [B, L-1, hidden]; slot j of step s predicts token j+2 and is meaningful for
        j >= s (earlier slots have no chain to continue)."""
        slots = tokens.shape[1] - 1
        positions = torch.arange(slots, device=tokens.device)
        rope = self._rope(positions, self.dtype)
        attn = self.midlayer.self_attn
        hidden, keys, values, outputs = fused[:, :slots], [], [], []
        for s in range(steps):
            if s:
                hidden = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))  # slot j reads step s-1's slot j-1
            x = self.midlayer.attention_input(self.embed_tokens(tokens[:, 1:]).to(hidden.dtype), hidden)
            k, v = attn.keys_values(x, rope)
            keys.append(k)
            values.append(v)
            mask = torch.cat([positions[None, :] <= positions[:, None] - s]
                             + [positions[None, :] == positions[:, None] - s + i for i in range(1, s + 1)], dim=1)
            out = F.scaled_dot_product_attention(attn.queries(x, rope), torch.cat(keys, 2), torch.cat(values, 2),
                                                 attn_mask=mask, enable_gqa=attn.n_kv != attn.n_heads)
            b = tokens.shape[0]
            outputs.append(self.midlayer.finish(hidden, out.transpose(1, 2).reshape(b, slots, -1)))
        return outputs
