"""Shared fixtures: checkpoints written once per session (float64 weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import tiny_config, tiny_dflash_config, tiny_eagle3_config, write_model
from tests.synthetic import BLOCK, train_dflash_drafter, train_eagle3_drafter, train_pair


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "target", tiny_config(), seed=0)


@pytest.fixture(scope="session")
def random_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random")
    target = write_model(root / "target", tiny_config(eos_token_ids=()), seed=0)
    return {
        "random-dflash": write_model(root / "dflash", tiny_dflash_config(tiny_config(eos_token_ids=())), seed=11),
        "random-eagle3": write_model(root / "eagle3", tiny_eagle3_config(tiny_config(eos_token_ids=())), seed=12),
        "target": target,
        "self": target,  # AR drafter sharing the target's weights: full acceptance
        "random-ar": write_model(root / "ar", tiny_config(eos_token_ids=()), seed=7),
        "random-dllm": write_model(root / "dllm", tiny_config(eos_token_ids=(), mask_token_id=95, block_size=BLOCK,
                                                              sub_block_size=4), seed=9),
    }


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory) -> tuple[Path, Path]:
    return train_pair(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="session")
def trained_dflash(trained_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(counting target, DFlash drafter trained on its features)."""
    target_dir, _ = trained_pair
    return target_dir, train_dflash_drafter(tmp_path_factory.mktemp("dflash"), target_dir)


@pytest.fixture(scope="session")
def trained_eagle3(trained_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(counting target, EAGLE-3 drafter trained on its features)."""
    target_dir, _ = trained_pair
    return target_dir, train_eagle3_drafter(tmp_path_factory.mktemp("eagle3"), target_dir)
