"""Search spaces: PLoRA's default, alpha as a multiple of rank, grid and random helpers."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

import lora_sweep as ls
from lora_sweep.space import (
    PLORA_SPACE, Categorical, Float, Int, check_space, config_from_params, default_space, grid_configs,
    random_configs,
)


def test_plora_table_1_bounds():
    assert PLORA_SPACE["learning_rate"] == Float(2e-5, 4e-4, log=True)
    assert PLORA_SPACE["batch_size"] == Int(1, 32, log=True)
    assert PLORA_SPACE["rank"] == Int(8, 128, log=True)
    assert PLORA_SPACE["alpha_ratio"] == Float(0.25, 4.0, log=True)


def test_alpha_ratio_becomes_alpha():
    cfg = config_from_params({"rank": 16, "alpha_ratio": 0.25}, {"max_steps": 7})
    assert (cfg.alpha, cfg.rank, cfg.max_steps) == (4.0, 16, 7)
    with pytest.raises(ls.ConfigError, match="alpha"):
        config_from_params({"rank": 16, "alpha_ratio": 2.0, "alpha": 3.0})
    with pytest.raises(ls.ConfigError, match="alpha_ratio"):
        config_from_params({"rank": 16, "alpha_ratio": -1.0})


def test_invalid_values_raise_config_error_naming_the_field():
    with pytest.raises(ls.ConfigError, match="learning_rate"):
        config_from_params({"learning_rate": -1.0})
    with pytest.raises(ls.ConfigError, match="unknown"):
        config_from_params({"lr": 1e-3})


def test_check_space():
    check_space(["learning_rate", "rank", "alpha_ratio"], fixed=["max_steps"])
    with pytest.raises(ls.ConfigError, match="both in the search space and fixed"):
        check_space(["rank"], fixed=["rank"])
    with pytest.raises(ls.ConfigError, match="unknown"):
        check_space(["rnk"])
    with pytest.raises(ls.ConfigError, match="alpha"):
        check_space(["alpha_ratio"], fixed=["alpha"])


def test_default_space_drops_fixed_fields():
    assert set(default_space(fixed=["batch_size"])) == {"learning_rate", "rank", "alpha_ratio"}
    assert "alpha_ratio" not in default_space(fixed=["alpha"])
    assert set(PLORA_SPACE) == {"learning_rate", "batch_size", "rank", "alpha_ratio"}  # unchanged


def test_grid_of_plora_space():
    configs = grid_configs(points=5, defaults={"max_steps": 10})
    assert len(configs) == 5**4
    assert sorted({c.rank for c in configs}) == [8, 16, 32, 64, 128]
    assert sorted({c.batch_size for c in configs}) == [1, 2, 6, 13, 32]  # log-spaced, rounded
    assert sorted({round(c.alpha / c.rank, 9) for c in configs}) == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert all(c.max_steps == 10 for c in configs)


def test_random_configs_are_seeded_and_in_bounds():
    a = random_configs(n=50, seed=3)
    assert a == random_configs(n=50, seed=3)
    assert a != random_configs(n=50, seed=4)
    for c in a:
        assert 2e-5 <= c.learning_rate <= 4e-4
        assert 1 <= c.batch_size <= 32 and 8 <= c.rank <= 128
        assert c.rank / 4 - 1e-9 <= c.alpha <= 4 * c.rank + 1e-9


def test_dimensions():
    rng = random.Random(0)
    assert all(3 <= Int(3, 9).sample(rng) <= 9 for _ in range(100))
    assert Int(1, 100, log=True).grid(3) == [1, 10, 100]
    assert Categorical(["linear", "cosine"]).grid(9) == ["linear", "cosine"]
    assert Float(0.0, 1.0).grid(3) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="low > 0"):
        Float(0.0, 1.0, log=True)
    with pytest.raises(ValueError, match="low <= high"):
        Int(5, 1)
    with pytest.raises(TypeError):
        Int(1.5, 3)
    with pytest.raises(ValueError, match="at least one"):
        Categorical([])


def test_space_module_imports_no_tuner():
    code = "import sys, lora_sweep.space; assert not any(m.split('.')[0] in ('optuna', 'ray') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_space_clips_ranks_to_the_model(caplog):
    with caplog.at_level("WARNING", logger="lora_sweep.space"):
        assert default_space(max_rank=64)["rank"] == Int(8, 64, log=True)
        assert default_space(max_rank=4)["rank"] == Int(4, 4, log=True)
        assert default_space(max_rank=512)["rank"] == PLORA_SPACE["rank"]  # wide enough: unchanged, silent
        assert "rank" not in default_space(fixed=["rank"], max_rank=4)
    assert [r.getMessage() for r in caplog.records] == [
        "The default search space's ranks 8..128 are clipped to 8..64: the model's smallest targeted layer is 64 wide.",
        "The default search space's ranks 8..128 are clipped to 4..4: the model's smallest targeted layer is 4 wide."]
    with pytest.raises(ValueError, match="max_rank"):
        default_space(max_rank=0)
