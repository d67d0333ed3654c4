"""failfast: lossless speculative decoding with a block-diffusion drafter and dynamic draft length."""

from failfast.drafters import ARDrafter, BlockDiffusionDrafter, CausalWindowDrafter, DFlashDrafter, Drafter, make_drafter
from failfast.drafters.lookup import LookupDrafter, LookupSettings
from failfast.decode.engine import GenerationRequest, GenerationResult, SpeculativeEngine
from failfast.errors import (CheckpointError, FailfastError, GenerationInputError,
                             IncompatibleModelsError, PolicyError)
from failfast.model import LoadedModel, load_model
from failfast.pipeline import Pipeline
from failfast.decode.costs import CostProfile, measure_costs
from failfast.decode.gate import SpeculationGate
from failfast.decode.policies import (CostAware, FailFast, FailFastDefaults, Fixed, Policy, PolicyFactory, cost_aware,
                                     drafter_failfast, failfast_for)
from failfast.decode.stats import GenerationStats, RoundStats
from failfast.decode.sampling import SamplingParams

__all__ = [
    "ARDrafter", "BlockDiffusionDrafter", "CausalWindowDrafter", "CheckpointError", "DFlashDrafter", "CostAware", "CostProfile", "Drafter", "FailFast",
    "FailFastDefaults",
    "FailfastError", "Fixed", "GenerationInputError", "GenerationRequest", "GenerationResult", "GenerationStats",
    "IncompatibleModelsError", "LoadedModel", "LookupDrafter", "LookupSettings", "Pipeline", "Policy", "PolicyError", "PolicyFactory", "RoundStats",
    "SamplingParams", "SpeculationGate", "SpeculativeEngine", "cost_aware", "drafter_failfast", "failfast_for", "load_model", "make_drafter", "measure_costs",
]
