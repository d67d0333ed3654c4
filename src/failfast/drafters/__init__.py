"""Drafters: autoregressive, block-diffusion (block modes and causal windows), DFlash and EAGLE-3 (target-conditioned), and prompt
lookup in front of any of them, behind one `Drafter` protocol."""

from failfast.drafters.autoregressive import ARDrafter
from failfast.drafters.base import Drafter
from failfast.drafters.block_diffusion import BlockDiffusionDrafter
from failfast.drafters.causal_window import CausalWindowDrafter
from failfast.drafters.dflash import DFlashDrafter
from failfast.drafters.factory import make_drafter

__all__ = ["ARDrafter", "BlockDiffusionDrafter", "CausalWindowDrafter", "DFlashDrafter", "Drafter", "make_drafter"]
