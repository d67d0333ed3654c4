"""Every decoding method the benchmark compares, all on the same target.

A method turns (prompt ids, max new tokens, plain-AR reference) into a `MethodOutput`.
The reference is used only by the oracle, which drafts the target's own continuation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from failfast.drafters import Drafter, make_drafter
from failfast.drafters.lookup import LookupDrafter, LookupSettings
from failfast.embedded import resolve_model
from failfast.drafters.block_diffusion import DEFAULT_UNMASK_THRESHOLD
from failfast.bench.oracle import OracleDrafter
from failfast.decode.engine import SpeculativeEngine
from failfast.model import LoadedModel, load_model
from failfast.model.int8 import load_drafter
from failfast.decode.policies import FailFast, Fixed, Policy, PolicyFactory, cost_aware, drafter_failfast
from failfast.decode.sampling import SamplingParams
from failfast.decode.stats import GenerationStats
from failfast.errors import GenerationInputError
from failfast.integrations.vllm_peers import (VLLM_METHODS, VllmGenerator, proposer_config, speculative_config,
                                              vllm_available)


@dataclass
class MethodOutput:
    token_ids: list[int]
    stats: GenerationStats | None  # None for transformers methods (no internals exposed); vLLM's without timings


Runner = Callable[[list[int], int, list[int]], MethodOutput]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    kind: str                      # ar | hf | hf-assisted | vllm | <drafter>-drafter | lookup | oracle
    policy: Policy | PolicyFactory | None = None
    unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD
    denoise: str | None = None  # a mask-token drafter's pass (None: its own): causal, sliding, prefix, sub-block or full-block
    sub_block_size: int | None = None  # None: the drafter's config (sliding: each request's size)
    schedule: str | None = None    # transformers assisted generation schedule
    drafter_dtype: torch.dtype | None = None  # None: the target's dtype
    drafter_int8: bool | None = None  # int8 weights in the drafter's linear layers; None: where they pay (model/int8.py)
    full_vocab: bool = False       # ignore the drafter's draft_vocab.json (the head over every token)
    lookup: LookupSettings | None = None  # prompt lookup in front of the drafter (kind "lookup": alone)
    coupled_drafts: bool = True    # sampled drafts with the verifier's noise (decode/sampling.py); else greedy

    @property
    def is_peer(self) -> bool:
        """Another engine on the same weights: its own kernels round differently from ours (in
        float32 too, since ours are failfast's own on AVX-512 CPUs), so at a near-tie its tokens
        may differ from our plain AR (reported, not an error)."""
        return self.kind in ("hf", "hf-assisted", "vllm")


DFLASH_BLOCK = 16  # the shipped DFlash drafter's block
EAGLE3_SWEEP = (3, 5, 8, 12)  # fixed chain lengths swept for the `eagle3` baseline
EAGLE3_BEST_K = 5         # the sweep's fastest on the embedded models (README, "Choosing the drafting defaults")
LOOKUP_KINDS = (("", "dllm"), ("-dflash", "dflash"), ("-eagle3", "eagle3"))  # method infix, drafter kind


def default_methods() -> list[MethodSpec]:
    # `failfast`, `failfast-dflash` and `failfast-eagle3` run FailFast with each drafter kind's
    # measured tau and chunk N (policies.drafter_failfast; README, "Choosing the drafting
    # defaults"); the variants change one setting of the block-diffusion drafter's (tau 0.6, N 4).
    ff = FailFast(tau=0.6, chunk=4)
    return [
        MethodSpec("ar", "ar"),
        MethodSpec("hf-generate", "hf"),
        MethodSpec("hf-assisted", "hf-assisted"),
        MethodSpec("hf-assisted-heuristic", "hf-assisted", schedule="heuristic"),
        MethodSpec("ar-fixed-4", "ar-drafter", Fixed(4)),
        MethodSpec("ar-fixed-8", "ar-drafter", Fixed(8)),
        MethodSpec("ar-dynamic", "ar-drafter", drafter_failfast()),
        *(MethodSpec(f"dllm-fixed-{k}", "dllm-drafter", Fixed(k)) for k in (3, 4, 5, 10, 20)),
        MethodSpec("failfast", "dllm-drafter", drafter_failfast()),
        MethodSpec("failfast-tau0.3", "dllm-drafter", FailFast(tau=0.3, chunk=4)),
        MethodSpec("failfast-tau0.45", "dllm-drafter", FailFast(tau=0.45, chunk=4)),  # the paper's threshold
        MethodSpec("failfast-tau0.8", "dllm-drafter", FailFast(tau=0.8, chunk=4)),
        *(MethodSpec(f"failfast-N{n}", "dllm-drafter", FailFast(tau=0.6, chunk=n)) for n in (2, 8, 10, 20)),
        MethodSpec("failfast-paper", "dllm-drafter", FailFast(tau=0.45, chunk=10)),  # tau and N of the paper
        MethodSpec("failfast-Nmax30", "dllm-drafter", FailFast(tau=0.6, chunk=4, max_draft=30)),
        MethodSpec("failfast-u0.3", "dllm-drafter", ff, unmask_threshold=0.3, denoise="sliding"),
        MethodSpec("failfast-u0.05", "dllm-drafter", ff, unmask_threshold=0.05, denoise="sliding"),  # the paper's threshold
        MethodSpec("failfast-u0.9", "dllm-drafter", ff, unmask_threshold=0.9, denoise="sliding"),  # several passes per sub-block
        # the block-diffusion drafter's passes named (the methods above use its config's mode)
        *(MethodSpec(f"failfast-{mode}", "dllm-drafter", drafter_failfast(), denoise=mode) for mode in ("sliding", "causal")),
        *(MethodSpec(f"dllm-fixed-4-{mode}", "dllm-drafter", Fixed(4), denoise=mode) for mode in ("sliding", "causal")),
        MethodSpec("failfast-prefix", "dllm-drafter", ff, denoise="prefix"),  # windows aligned to sub-blocks
        MethodSpec("dllm-fixed-4-prefix", "dllm-drafter", Fixed(4), denoise="prefix"),
        MethodSpec("failfast-full-block", "dllm-drafter", ff, denoise="full-block"),
        MethodSpec("failfast-sub-block", "dllm-drafter", ff, denoise="sub-block"),  # Fast-dLLM v2's block cache
        MethodSpec("failfast-s4", "dllm-drafter", ff, sub_block_size=4, denoise="prefix"),  # aligned sub-blocks of 4
        MethodSpec("failfast-s16", "dllm-drafter", ff, sub_block_size=16, denoise="prefix"),
        MethodSpec("failfast-window8", "dllm-drafter", ff, sub_block_size=8, denoise="sliding"),  # sliding windows fixed at 8
        MethodSpec("failfast-drafter-fp32", "dllm-drafter", ff, drafter_dtype=torch.float32),
        # int8 drafter weights (model/int8.py): on by default where they pay, so the A/B of each
        # kind is the method against its -no-int8 or -int8 twin
        MethodSpec("failfast-drafter-int8", "dllm-drafter", ff, drafter_int8=True),
        MethodSpec("ar-fixed-8-no-int8", "ar-drafter", Fixed(8), drafter_int8=False),
        MethodSpec("failfast-eagle3-int8", "eagle3-drafter", drafter_failfast(), drafter_int8=True),
        MethodSpec("failfast-dflash-int8", "dflash-drafter", drafter_failfast(), drafter_int8=True),
        MethodSpec("failfast-cost", "dllm-drafter", cost_aware()),  # costs measured on the first prompt
        MethodSpec("failfast-full-vocab", "dllm-drafter", ff, full_vocab=True),
        MethodSpec("ar-fixed-4-full-vocab", "ar-drafter", Fixed(4), full_vocab=True),
        # DFlash: one pass drafts a block (15 tokens after the last committed one); Fixed(K) keeps
        # K of them (`dflash-fixed-16`: the whole block); FailFast extends a confident draft
        *(MethodSpec(f"dflash-fixed-{k}", "dflash-drafter", Fixed(k)) for k in (4, 6, 8)),
        MethodSpec("dflash-fixed-16", "dflash-drafter", Fixed(DFLASH_BLOCK - 1)),
        MethodSpec("failfast-dflash", "dflash-drafter", drafter_failfast()),
        MethodSpec("failfast-dflash-block", "dflash-drafter", FailFast(chunk=DFLASH_BLOCK - 1)),  # a block per chunk
        MethodSpec("failfast-dflash-cost", "dflash-drafter", cost_aware()),
        # EAGLE-3: a chain of one token per pass; its best fixed length by the README's sweep
        *(MethodSpec(f"eagle3-fixed-{k}", "eagle3-drafter", Fixed(k)) for k in EAGLE3_SWEEP),
        MethodSpec("eagle3", "eagle3-drafter", Fixed(EAGLE3_BEST_K)),
        MethodSpec("failfast-eagle3", "eagle3-drafter", drafter_failfast()),
        *(MethodSpec(f"failfast-eagle3-N{n}", "eagle3-drafter", FailFast(tau=0.8, chunk=n)) for n in (1, 4)),
        *(MethodSpec(f"failfast-eagle3-tau{t}", "eagle3-drafter", FailFast(tau=t, chunk=2)) for t in (0.45, 0.7, 0.9)),
        MethodSpec("failfast-eagle3-cost", "eagle3-drafter", cost_aware()),
        # prompt lookup: copies of earlier text, alone (vLLM's ngram) and in front of each drafter
        # kind (the rounds without a copy use the drafter); -n2 needs a match of two tokens or more
        *(MethodSpec(f"lookup-fixed-{k}", "lookup", Fixed(k), lookup=LookupSettings(max_tokens=k)) for k in (4, 8, 16)),
        MethodSpec("lookup-n2", "lookup", Fixed(8), lookup=LookupSettings(min_ngram=2)),
        *(MethodSpec(f"failfast{kind}-lookup", f"{drafter}-drafter", drafter_failfast(), lookup=LookupSettings())
          for kind, drafter in LOOKUP_KINDS),
        *(MethodSpec(f"failfast{kind}-lookup-n2", f"{drafter}-drafter", drafter_failfast(),
                     lookup=LookupSettings(min_ngram=2)) for kind, drafter in LOOKUP_KINDS),
        *(MethodSpec(f"failfast-lookup-{k}", "dllm-drafter", drafter_failfast(), lookup=LookupSettings(max_tokens=k))
          for k in (4, 16)),
        MethodSpec("failfast-lookup-drafter-int8", "dllm-drafter", drafter_failfast(), lookup=LookupSettings(),
                   drafter_int8=True),
        # sampled generation (--temperature): the same drafters drafting greedily instead of with
        # the verifier's noise (coupled drafting, the default), for the A/B
        *(MethodSpec(f"{name}-greedy-drafts", kind, policy, coupled_drafts=False)
          for name, kind, policy in (("failfast", "dllm-drafter", drafter_failfast()),
                                     ("failfast-dflash", "dflash-drafter", drafter_failfast()),
                                     ("failfast-eagle3", "eagle3-drafter", drafter_failfast()),
                                     ("ar-fixed-4", "ar-drafter", Fixed(4)))),
        MethodSpec("oracle", "oracle", Fixed(60)),
        # vLLM on the same weights, when installed (the vllm extra): plain, its own speculative
        # methods, and our proposer inside it (integrations/vllm_peers.py)
        *(MethodSpec(name, "vllm") for name in (VLLM_METHODS if vllm_available() else ())),
    ]


class MethodFactory:
    """Loads each model once and builds runners that share them."""

    def __init__(self, target: Path, drafters: dict[str, str | Path], dtype: torch.dtype = torch.float32,
                 sampling: SamplingParams = SamplingParams()) -> None:
        """`drafters`: folder or embedded name of each drafter kind (ar, dllm, dflash, eagle3; any
        other name X serves methods of kind "X-drafter"), resolved when a method first needs it. `sampling`: how our engines pick tokens (seeded
        sampling is reproduced token for token by every method, decode/sampling.py); peers
        (transformers, vLLM) decode greedily only."""
        self.paths: dict[str, str | Path] = {"target": target, **drafters}
        self.dtype = dtype
        self.sampling = sampling
        self.target = load_model(target, dtype=dtype)
        self._loaded: dict[tuple[str, torch.dtype, bool], LoadedModel] = {}
        self._hf: dict[str, torch.nn.Module] = {}
        self._vllm: dict[str, VllmGenerator] = {}

    def _drafter_model(self, which: str, dtype: torch.dtype | None = None, int8: bool | None = None) -> LoadedModel:
        key = (which, dtype or self.dtype, int8)
        if key not in self._loaded:
            self._loaded[key] = load_drafter(resolve_model(self.paths[which]), key[1], int8=int8)
        return self._loaded[key]

    def _hf_model(self, which: str) -> torch.nn.Module:
        if which not in self._hf:
            from transformers import Qwen2ForCausalLM
            self._hf[which] = Qwen2ForCausalLM.from_pretrained(resolve_model(self.paths[which]), dtype=self.dtype).eval()
        return self._hf[which]

    def _hf_runner(self, assistant: torch.nn.Module | None, schedule: str | None) -> Runner:
        model = self._hf_model("target")
        eos = list(self.target.config.eos_token_ids) or None

        def run(prompt: list[int], max_new: int, reference: list[int]) -> MethodOutput:
            ids = torch.tensor([prompt])
            kwargs = {}
            if assistant is not None:
                assistant.generation_config.num_assistant_tokens_schedule = schedule or "constant"
                assistant.generation_config.num_assistant_tokens = 20
                kwargs["assistant_model"] = assistant
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                     do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **kwargs)
            return MethodOutput(out[0, len(prompt):].tolist(), None)
        return run

    def _vllm_runner(self, method: str) -> Runner:
        """A vLLM engine per peer method, on the target's folder and dtype; `vllm-draft-model`
        drafts with the AR drafter, `vllm-failfast[-ungated]` with the block-diffusion drafter."""
        if method not in self._vllm:
            self._vllm[method] = VllmGenerator(
                resolve_model(self.paths["target"]), self.dtype,
                speculative_config(method, resolve_model(self.paths["ar"])),
                proposer_config(method, str(resolve_model(self.paths["dllm"])), self.dtype))
        generator = self._vllm[method]

        def run(prompt: list[int], max_new: int, reference: list[int]) -> MethodOutput:
            completion = generator.generate([prompt], max_new)[0]
            return MethodOutput(completion.token_ids, completion.stats)
        return run

    def runner(self, spec: MethodSpec) -> Runner:
        if spec.is_peer and (not self.sampling.greedy or self.sampling.penalized):
            raise GenerationInputError(f"peer method {spec.name!r} is compared greedily without penalties only; "
                                       "drop it or the sampling settings")
        if spec.kind == "vllm":
            return self._vllm_runner(spec.name)
        if spec.kind == "hf":
            return self._hf_runner(None, None)
        if spec.kind == "hf-assisted":
            return self._hf_runner(self._hf_model("ar"), spec.schedule)
        drafter: Drafter | None = None
        which = spec.kind.removesuffix("-drafter")
        if spec.kind.endswith("-drafter") and which in self.paths:  # a drafter as make_drafter builds it for users
            drafter = make_drafter(self.target, self._drafter_model(which, spec.drafter_dtype, spec.drafter_int8),
                                   spec.unmask_threshold, spec.denoise, spec.sub_block_size, spec.full_vocab)
        elif spec.kind == "oracle":
            def run_oracle(prompt: list[int], max_new: int, reference: list[int]) -> MethodOutput:
                oracle = SpeculativeEngine(self.target, OracleDrafter(len(prompt), reference), spec.policy)
                result = oracle.generate(prompt, max_new, self.sampling)
                return MethodOutput(result.token_ids, result.stats)
            return run_oracle
        elif spec.kind not in ("ar", "lookup"):
            raise ValueError(f"unknown method kind {spec.kind!r}")
        if spec.lookup is not None:
            drafter = LookupDrafter(drafter, spec.lookup)
        engine = SpeculativeEngine(self.target, drafter, spec.policy, coupled_drafts=spec.coupled_drafts)

        def run(prompt: list[int], max_new: int, reference: list[int]) -> MethodOutput:
            result = engine.generate(prompt, max_new, self.sampling)
            return MethodOutput(result.token_ids, result.stats)
        return run
