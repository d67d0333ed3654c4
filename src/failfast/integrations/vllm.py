"""FailFast drafting inside vLLM, through its custom-class proposer hook (docs/design.md, "vLLM").

vLLM (0.32, `vllm/v1/spec_decode/custom_class_proposer.py`) builds the class named by
`speculative_config["model"]` with its `VllmConfig`, and after every step calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`: one list
of newly sampled ids per batch row (empty while a row is still prefilling), each row's
token count and the `[rows, max_model_len]` token table. It returns one draft list per row,
whose lengths may differ, capped by `num_speculative_tokens`; the target verifies them in
its next step. Here each row's draft comes from a token-only failfast drafter (the
block-diffusion drafter by default) under the FailFast policy with N_max =
`num_speculative_tokens`, drafted by the same code as failfast's own engine
(`decode/drafting.py`).

Use (the drafter and policy settings are JSON in $FAILFAST_VLLM_CONFIG, see `ProposerConfig`):

    LLM(model=TARGET_DIR, speculative_config={"method": "custom_class",
        "model": "failfast.integrations.vllm.FailFastProposer", "num_speculative_tokens": 32})

vLLM does not say which request a row holds, and rows move when requests finish. Each row
keeps a drafter whose cache is keyed by the tokens it holds: `begin` reuses the longest
cached prefix of the row's tokens, so the same request continues where it was and a new
request in the row starts over. Rows beyond the current batch are freed.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import torch

from failfast.decode.drafting import draft_alone, draft_together
from failfast.decode.gate import SpeculationGate
from failfast.decode.policies import failfast_for
from failfast.drafters import Drafter, make_drafter
from failfast.drafters.block_diffusion import DEFAULT_UNMASK_THRESHOLD
from failfast.drafters.lookup import LookupDrafter, LookupSettings
from failfast.embedded import DEFAULT_DRAFTER, resolve_model
from failfast.errors import GenerationInputError
from failfast.model import KVCache, describe_model
from failfast.model.int8 import load_drafter
from failfast.model.precision import resolve_dtype

CONFIG_ENV = "FAILFAST_VLLM_CONFIG"


@dataclass(frozen=True)
class ProposerConfig:
    """The drafter and its FailFast policy; N_max is vLLM's `num_speculative_tokens`.

    `drafter`: a checkpoint folder or embedded name (an AR or block-diffusion drafter: DFlash
    and EAGLE-3 read target hidden states that the hook does not pass). `dtype`: the drafter's
    ("auto": bfloat16 where it is fast; a bfloat16 drafter on a CPU gets int8 weights, as in
    `failfast generate`). `batched`: draft every row of a step together in one
    forward per pass (same drafts as one row at a time). `gate`: skip drafting in steps where
    plain steps measure faster (decode/gate.py; the rate of a step is the tokens vLLM
    committed in it over the time from one `propose` call to the next). `lookup_tokens`:
    prompt lookup in front of the drafter, copying up to this many tokens (None: off;
    docs/design.md, "Prompt lookup").
    """

    drafter: str = DEFAULT_DRAFTER
    tau: float | None = None   # None: the drafter kind's (policies.failfast_for)
    chunk: int | None = None
    dtype: str = "auto"
    unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD
    denoise: str | None = None  # None: the drafter's own mode (drafters/factory.py)
    batched: bool = True
    gate: bool = True
    lookup_tokens: int | None = None

    @classmethod
    def from_env(cls) -> "ProposerConfig":
        """$FAILFAST_VLLM_CONFIG: a JSON object, or the path of a file holding one; unset means defaults."""
        raw = os.environ.get(CONFIG_ENV, "").strip()
        if not raw:
            return cls()
        text = raw if raw.startswith("{") else _read(raw)
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GenerationInputError(f"${CONFIG_ENV} is not a JSON object: {exc}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - known:
            raise GenerationInputError(f"${CONFIG_ENV} must be an object with keys among {sorted(known)}, got {values!r}")
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment entry that makes vLLM's worker processes read this config."""
        return {CONFIG_ENV: json.dumps(asdict(self))}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise GenerationInputError(f"${CONFIG_ENV}: cannot read {path}: {exc}") from None


class FailFastProposer:
    """vLLM's custom-class proposer: FailFast-length drafts from a failfast drafter, per batch row."""

    def __init__(self, vllm_config: Any, config: ProposerConfig | None = None,
                 gate: SpeculationGate | None = None) -> None:
        """`gate` replaces the default `SpeculationGate()` of a config with `gate` on."""
        self.config = config or ProposerConfig.from_env()
        self.gate = gate or (SpeculationGate() if self.config.gate else None)
        self._last_step: tuple[int, bool, float] | None = None  # rows, speculated, when it was proposed
        spec = vllm_config.speculative_config
        self.max_draft = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        target = describe_model(vllm_config.model_config.model)
        # int8 weights where they measured faster, as `failfast generate` does (model/int8.py)
        loaded = load_drafter(resolve_model(self.config.drafter), resolve_dtype(self.config.dtype))
        self.drafter = make_drafter(target, loaded, self.config.unmask_threshold, self.config.denoise)
        if self.config.lookup_tokens is not None:
            self.drafter = LookupDrafter(self.drafter, LookupSettings(max_tokens=self.config.lookup_tokens))
        chunk = None if self.config.chunk is None else min(self.config.chunk, self.max_draft)
        self.policy = failfast_for(self.drafter, self.config.tau, chunk, self.max_draft)
        self.batched = self.config.batched and getattr(self.drafter, "batchable", False)
        self.rows: list[Drafter] = []
        self.shared: KVCache | None = None
        self.shared_rows = 0

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's model-loading call: the drafter is loaded in `__init__`."""

    def _ensure_rows(self, count: int) -> None:
        """A prepared drafter per batch row; rows beyond `count` are freed. Batched drafters
        share one cache, grown in powers of two (every row starts over when it grows)."""
        if self.batched and count > self.shared_rows:
            self.shared_rows = 1 << (count - 1).bit_length()
            self.shared = self.drafter.model.new_cache(self.drafter.batch_capacity(self.max_model_len),
                                                       batch=self.shared_rows)
            self.rows = []
        while len(self.rows) < count:
            drafter = copy.copy(self.drafter)  # `prepare` gives the copy its own per-sequence state
            if self.shared is not None:
                drafter.prepare(self.max_model_len, cache=self.shared.row(len(self.rows)))  # type: ignore[call-arg]
            else:
                drafter.prepare(self.max_model_len)
            self.rows.append(drafter)
        del self.rows[count:]

    @torch.inference_mode()
    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """One draft per batch row: empty for a row without newly sampled tokens (still
        prefilling) or at the length limit, else as many tokens as FailFast asks for."""
        self._ensure_rows(len(sampled_token_ids))
        if not self._speculate(sampled_token_ids):
            return [[] for _ in sampled_token_ids]
        rows: dict[int, tuple[list[int], int]] = {}
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            budget = min(self.max_draft, self.max_model_len - n - 1)
            if len(sampled) and budget > 0:
                rows[i] = ([int(t) for t in token_ids_cpu[i, :n]], budget)
        if self.shared is not None and len(rows) > 1:
            drafted = draft_together(self.rows, self.policy, rows, self.shared)
        else:
            drafted = {i: draft_alone(self.rows[i], self.policy, committed, budget)
                       for i, (committed, budget) in rows.items()}
        return [drafted[i][0] if i in drafted else [] for i in range(len(sampled_token_ids))]

    def _speculate(self, sampled_token_ids: Sequence[Sequence[int]]) -> bool:
        """Report the last step to the gate (its committed tokens arrive now) and ask about this one."""
        if self.gate is None:
            return True
        now = time.perf_counter()
        decoding = sum(1 for s in sampled_token_ids if len(s))
        # a step in which rows joined or were prefilling also did their prefill: not a decoding rate
        if self._last_step is not None and self._last_step[0] == decoding == len(sampled_token_ids):
            rows, speculated, then = self._last_step
            self.gate.record(rows, speculated, sum(len(s) for s in sampled_token_ids), now - then)
        speculate = self.gate.speculate(decoding) if decoding else True
        self._last_step = (decoding, speculate, now) if decoding else None
        return speculate
