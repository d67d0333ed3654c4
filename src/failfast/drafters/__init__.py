"""Drafters: autoregressive, block-diffusion, DFlash and EAGLE-3 (target-conditioned), and prompt
lookup in front of any of them, behind one `Drafter` protocol."""

from failfast.drafters.autoregressive import ARDrafter
from failfast.drafters.base import Drafter
from failfast.drafters.block_diffusion import BlockDiffusionDrafter
from failfast.drafters.dflash import DFlashDrafter
from failfast.drafters.factory import make_drafter

__all__ = ["ARDrafter", "BlockDiffusionDrafter", "DFlashDrafter", "Drafter", "make_drafter"]
