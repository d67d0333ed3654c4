"""Drafters: autoregressive and block-diffusion, behind one `Drafter` protocol."""

from failfast.drafters.autoregressive import ARDrafter
from failfast.drafters.base import Drafter
from failfast.drafters.block_diffusion import BlockDiffusionDrafter
from failfast.drafters.factory import make_drafter

__all__ = ["ARDrafter", "BlockDiffusionDrafter", "Drafter", "make_drafter"]
