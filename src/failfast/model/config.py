"""Model configuration read from a Hugging Face `config.json` (Qwen2 and Qwen3 families,
DFlash drafters in z-lab's layout, and our EAGLE-3 drafters)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from failfast.errors import CheckpointError

# Fast-dLLM v2 checkpoints do not store their mask token id in config.json.
FAST_DLLM_MODEL_TYPE = "Fast_dLLM_Qwen"
FAST_DLLM_MASK_TOKEN_ID = 151665
DEFAULT_BLOCK_SIZE = 32
DEFAULT_SUB_BLOCK_SIZE = 8
DFLASH_ARCHITECTURE = "DFlashDraftModel"  # z-lab's DFlash drafters (docs/design.md, "Target-conditioned drafting")
EAGLE3_ARCHITECTURE = "Eagle3DraftModel"  # our EAGLE-3 drafters (docs/design.md, "EAGLE-3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    head_dim: int = 0
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen2"
    # Block diffusion (Fast-dLLM v2 semantics); None for plain AR checkpoints.
    mask_token_id: int | None = None
    block_size: int | None = None
    sub_block_size: int | None = None
    attention_bias: bool = True  # Qwen2: q/k/v projections have a bias; Qwen3: none
    qk_norm: bool = False        # Qwen3: per-head RMSNorm of queries and keys
    # A DFlash drafter reads the outputs of these target layers (block_size: its block); so
    # does an EAGLE-3 drafter (`eagle3`).
    target_layer_ids: tuple[int, ...] | None = None
    eagle3: bool = False
    # The drafting mode a mask-token drafter was trained for ("causal": causal windows,
    # drafters/causal_window.py); None: Fast-dLLM v2's block modes.
    failfast_denoise: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise CheckpointError("hidden_size must be divisible by num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def is_block_diffusion(self) -> bool:
        return self.block_size is not None and not self.is_dflash

    @property
    def reads_target(self) -> bool:
        """A drafter that reads target features and shares the target's embedding and head."""
        return self.target_layer_ids is not None

    @property
    def is_dflash(self) -> bool:
        return self.reads_target and not self.eagle3

    @property
    def is_eagle3(self) -> bool:
        return self.reads_target and self.eagle3

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a config.json dict; refuse features this runtime does not implement."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise CheckpointError(f"config.json lacks required fields: {', '.join(missing)}")
        if raw.get("rope_scaling"):
            raise CheckpointError("config.json uses rope_scaling, which failfast does not support")
        if raw.get("use_sliding_window"):
            raise CheckpointError("config.json enables sliding-window attention, which failfast does not support")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        model_type = raw.get("model_type", "qwen2")
        mask_id = raw.get("mask_token_id")
        block = raw.get("bd_size", raw.get("block_size"))
        if model_type == FAST_DLLM_MODEL_TYPE:
            mask_id = FAST_DLLM_MASK_TOKEN_ID if mask_id is None else mask_id
            block = DEFAULT_BLOCK_SIZE if block is None else block
        sub_block = raw.get("small_block_size")
        if block is not None and sub_block is None:
            sub_block = min(DEFAULT_SUB_BLOCK_SIZE, int(block))
        layer_ids = None
        if DFLASH_ARCHITECTURE in (raw.get("architectures") or []):
            dflash = raw.get("dflash_config") or {}
            if "target_layer_ids" not in dflash or "mask_token_id" not in dflash or block is None:
                raise CheckpointError("a DFlash config.json needs block_size and dflash_config with "
                                      "target_layer_ids and mask_token_id")
            layer_ids = _layer_ids(dflash["target_layer_ids"], "DFlash", "dflash_config.target_layer_ids")
            mask_id, sub_block = dflash["mask_token_id"], None
        eagle3 = EAGLE3_ARCHITECTURE in (raw.get("architectures") or [])
        if eagle3:
            layer_ids = _layer_ids((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), "EAGLE-3",
                                   "eagle_config.eagle_aux_hidden_state_layer_ids")
        known = set(cls.__dataclass_fields__) | {"dflash_config", "eagle_config"}
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim=int(raw.get("head_dim") or 0),
            eos_token_ids=eos_ids,
            model_type=model_type,
            mask_token_id=None if mask_id is None else int(mask_id),
            block_size=None if block is None else int(block),
            sub_block_size=None if sub_block is None else int(sub_block),
            attention_bias=bool(raw.get("attention_bias", model_type != "qwen3")),
            qk_norm=model_type == "qwen3",
            target_layer_ids=layer_ids,
            eagle3=eagle3,
            failfast_denoise=raw.get("failfast_denoise"),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """A config.json that both failfast and `transformers` (Qwen2 / Qwen3) can read; a
        DFlash drafter's in z-lab's layout."""
        out = {k: v for k, v in asdict(self).items()
               if k not in ("extra", "eos_token_ids", "block_size", "sub_block_size", "qk_norm", "target_layer_ids",
                             "eagle3")}
        out.update(self.extra)
        out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        if self.attention_bias == (self.model_type != "qwen3"):
            out.pop("attention_bias")  # the family's default (Qwen2 configs have no such field)
        if self.is_dflash:
            out["architectures"] = [DFLASH_ARCHITECTURE]
            out["block_size"] = self.block_size
            out["dflash_config"] = {"mask_token_id": out.pop("mask_token_id"),
                                    "target_layer_ids": list(self.target_layer_ids)}
        elif self.is_eagle3:
            out["architectures"] = [EAGLE3_ARCHITECTURE]
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids)}
        elif self.block_size is not None:
            out["bd_size"] = self.block_size
            out["small_block_size"] = self.sub_block_size
        if self.mask_token_id is None:
            out.pop("mask_token_id")
        if self.failfast_denoise is None:
            out.pop("failfast_denoise")
        out.setdefault("architectures", ["Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"])
        out.setdefault("hidden_act", "silu")
        return out


def _layer_ids(raw: Any, kind: str, field_name: str) -> tuple[int, ...]:
    """Target layer ids of a feature-reading drafter's config: distinct and ascending."""
    if not isinstance(raw, list) or not raw:
        raise CheckpointError(f"the config.json of an {kind} drafter needs {field_name}")
    ids = tuple(int(i) for i in raw)
    if list(ids) != sorted(set(ids)):
        raise CheckpointError(f"{kind} target layer ids must be distinct and ascending, got {list(ids)}")
    return ids
