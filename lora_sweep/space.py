"""Search spaces over `TrialConfig` fields, for any tuner.

A search space is a plain dict from a `TrialConfig` field name to a dimension: `Float`,
`Int` or `Categorical`. The tuner integrations translate these into their own
distributions (Optuna's `FloatDistribution`, Ray Tune's `tune.loguniform`, ...); this module
imports no tuner.

One name is not a `TrialConfig` field: ``alpha_ratio``. PEFT's ``lora_alpha`` only makes sense
relative to the rank (the LoRA term is scaled by alpha/rank), so a space may sample
``alpha_ratio`` and get ``alpha = alpha_ratio * rank``. The tuner records ``alpha_ratio``; the
`TrialConfig` it becomes holds the resulting ``alpha``, so the trial is reproducible from either.

`PLORA_SPACE` is the default: the space of PLoRA's Table 1
(https://arxiv.org/abs/2508.02932): learning rate 2e-5..4e-4, batch size 1..32, rank 8..128
and alpha r/4..4r, all on a log scale. `default_space(max_rank=...)` clips its ranks to a
model whose layers are narrower than 128.

    configs = grid_configs(PLORA_SPACE, points=3, defaults={"max_steps": 100})   # 81 trials
    configs = random_configs(PLORA_SPACE, 20, seed=0)
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import random
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Union

from .config import ConfigError, TrialConfig

__all__ = [
    "ALPHA_RATIO", "Categorical", "Dimension", "Float", "Int", "PLORA_SPACE",
    "check_space", "config_from_params", "default_space", "grid_configs", "random_configs",
]

logger = logging.getLogger(__name__)

ALPHA_RATIO = "alpha_ratio"  # the one space name that is not a TrialConfig field: alpha / rank


# --------------------------------------------------------------------------- dimensions


@dataclass(frozen=True)
class Float:
    """A real number in ``[low, high]``, uniform or (``log=True``) log-uniform."""

    low: float
    high: float
    log: bool = False

    def __post_init__(self):
        _check_bounds(self, self.low, self.high)

    def sample(self, rng: random.Random) -> float:
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def grid(self, points: int) -> list[float]:
        return _spaced(self.low, self.high, points, self.log)


@dataclass(frozen=True)
class Int:
    """An integer in ``[low, high]`` (both included), uniform or (``log=True``) log-uniform."""

    low: int
    high: int
    log: bool = False

    def __post_init__(self):
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (self.low, self.high)):
            raise TypeError(f"The bounds of `Int` must be integers, got low={self.low!r}, high={self.high!r}.")
        _check_bounds(self, self.low, self.high)

    def sample(self, rng: random.Random) -> int:
        if self.log:  # log-uniform over [low - 0.5, high + 0.5), then rounded, as Optuna does
            value = math.exp(rng.uniform(math.log(self.low - 0.5), math.log(self.high + 0.5)))
            return min(max(round(value), self.low), self.high)
        return rng.randint(self.low, self.high)

    def grid(self, points: int) -> list[int]:
        return sorted({round(v) for v in _spaced(self.low, self.high, points, self.log)})


@dataclass(frozen=True)
class Categorical:
    """One of a fixed set of choices."""

    choices: tuple

    def __post_init__(self):
        object.__setattr__(self, "choices", tuple(self.choices))
        if not self.choices:
            raise ValueError("The value of `choices` is (), but must hold at least one choice.")

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.choices)

    def grid(self, points: int) -> list:
        return list(self.choices)


Dimension = Union[Float, Int, Categorical]
SearchSpace = Mapping[str, Dimension]


def _check_bounds(dim, low, high) -> None:
    name = type(dim).__name__
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high)):
        raise TypeError(f"The bounds of `{name}` must be finite numbers, got low={low!r}, high={high!r}.")
    if low > high:
        raise ValueError(f"The value of `low` is {low}, but must be `low <= high` (high={high}) in `{name}`.")
    if dim.log and low <= 0:
        raise ValueError(f"The value of `low` is {low}, but must be `low > 0` for a log-scale `{name}`.")


def _spaced(low: float, high: float, points: int, log: bool) -> list[float]:
    if points < 1:
        raise ValueError(f"The value of `points` is {points}, but must be `points >= 1`.")
    if points == 1 or low == high:
        return [math.exp((math.log(low) + math.log(high)) / 2) if log else (low + high) / 2]
    if log:
        a, b = math.log(low), math.log(high)
        return [math.exp(a + (b - a) * i / (points - 1)) for i in range(points)]
    return [low + (high - low) * i / (points - 1) for i in range(points)]


# --------------------------------------------------------------------------- PLoRA's default space

PLORA_SPACE: dict[str, Dimension] = {
    "learning_rate": Float(2e-5, 4e-4, log=True),
    "batch_size": Int(1, 32, log=True),
    "rank": Int(8, 128, log=True),
    ALPHA_RATIO: Float(0.25, 4.0, log=True),  # alpha from rank/4 to 4 * rank
}


def default_space(fixed: Sequence[str] = (), max_rank: Optional[int] = None) -> dict[str, Dimension]:
    """`PLORA_SPACE` without the fields that `fixed` names (a fixed ``alpha`` drops ``alpha_ratio``),
    its ranks clipped to `max_rank` (logged when that narrows them).

    Example:

        .. code::

            default_space(fixed=["batch_size"])   # learning_rate, rank, alpha_ratio
            default_space(max_rank=64)            # ranks 8..64, for a model whose smallest targeted layer is 64 wide

    Args:
        fixed:
            `TrialConfig` field names whose values the caller fixes for every trial.
        max_rank:
            The largest rank the model takes: the smallest in/out dimension of its targeted
            layers. None: PLoRA's ranks as they are.

    Returns:
        A new dict; `PLORA_SPACE` itself is not changed.
    """
    fixed = set(fixed)
    if "alpha" in fixed:
        fixed.add(ALPHA_RATIO)
    space = {name: dim for name, dim in PLORA_SPACE.items() if name not in fixed}
    if max_rank is not None and not (isinstance(max_rank, numbers.Integral) and max_rank >= 1):
        raise ValueError(f"The value of `max_rank` is {max_rank!r}, but must be None or an integer >= 1.")
    rank = space.get("rank")
    if rank is not None and max_rank is not None and max_rank < rank.high:
        space["rank"] = Int(min(rank.low, max_rank), max_rank, log=rank.log)
        logger.warning("The default search space's ranks %d..%d are clipped to %d..%d: the model's smallest "
                       "targeted layer is %d wide.", rank.low, rank.high, space["rank"].low, max_rank, max_rank)
    return space


# --------------------------------------------------------------------------- params -> TrialConfig


_FIELDS = tuple(f.name for f in fields(TrialConfig) if f.name != "trial_id")


def check_space(names: Sequence[str], fixed: Sequence[str] = ()) -> None:
    """Raise `ConfigError` unless `names` (the sampled fields) and `fixed` (the fields every
    trial shares) are `TrialConfig` fields or ``alpha_ratio``, overlap nowhere and do not
    give ``alpha`` twice.

    Example:

        .. code::

            check_space(["learning_rate", "rank", "alpha_ratio"], fixed=["max_steps"])

    Args:
        names:
            The dimensions of the search space.
        fixed:
            The keys of the fixed fields (e.g. a tuner integration's ``trial_defaults``).
    """
    for what, keys in (("search space", names), ("fixed fields", fixed)):
        unknown = sorted(set(keys) - set(_FIELDS) - {ALPHA_RATIO})
        if unknown:
            raise ConfigError(f"The {what} has unknown field(s) {unknown}; known fields are "
                              f"{sorted(_FIELDS + (ALPHA_RATIO,))}.", field=unknown[0])
    both = sorted(set(names) & set(fixed))
    if both:
        raise ConfigError(f"The field(s) {both} are both in the search space and fixed; "
                          "keep each field in one of the two.", field=both[0])
    everything = set(names) | set(fixed)
    if {"alpha", ALPHA_RATIO} <= everything:
        raise ConfigError("Both `alpha` and `alpha_ratio` are given, but `alpha` must come from one of them "
                          "(alpha = alpha_ratio * rank).", field="alpha")


def config_from_params(params: Mapping[str, Any], defaults: Optional[Mapping[str, Any]] = None,
                       **overrides: Any) -> TrialConfig:
    """The `TrialConfig` of a tuner's sampled `params`, completed by `defaults`.

    ``alpha_ratio`` becomes ``alpha = alpha_ratio * rank``. Fields in neither `params` nor
    `defaults` keep `TrialConfig`'s defaults; `overrides` (e.g. ``trial_id``) win over both.

    Example:

        .. code::

            cfg = config_from_params({"rank": 16, "alpha_ratio": 2.0}, {"max_steps": 50})
            assert cfg.alpha == 32.0

    Args:
        params:
            Sampled values, keyed by `TrialConfig` field (or ``alpha_ratio``).
        defaults:
            Values of the fields the tuner does not sample.
        overrides:
            Values that replace both.

    Returns:
        The validated `TrialConfig`; an invalid value raises `ConfigError`.
    """
    values = {**(defaults or {}), **params, **overrides}
    if ALPHA_RATIO in values:
        ratio = values.pop(ALPHA_RATIO)
        if "alpha" in values:
            raise ConfigError("Both `alpha` and `alpha_ratio` are given, but `alpha` must come from one of them.",
                              field="alpha", trial_id=values.get("trial_id"))
        if not isinstance(ratio, numbers.Real) or isinstance(ratio, bool) or not ratio > 0:
            raise ConfigError(f"The value of `alpha_ratio` is {ratio!r}, but must be a number > 0.",
                              field=ALPHA_RATIO, trial_id=values.get("trial_id"))
        rank = values.get("rank", TrialConfig.rank)
        values["alpha"] = float(ratio) * rank if isinstance(rank, numbers.Real) else rank  # a bad rank fails below
    return TrialConfig.from_dict(values)


# --------------------------------------------------------------------------- grid and random search


def grid_configs(space: Optional[SearchSpace] = None, points: int = 3,
                 defaults: Optional[Mapping[str, Any]] = None) -> list[TrialConfig]:
    """Every combination of a grid over `space`: `points` values per numeric dimension
    (log-spaced on a log scale, integers rounded and deduplicated), every choice of a
    `Categorical`.

    Example:

        .. code::

            trials = grid_configs(points=2, defaults={"max_steps": 100})   # 2**4 corners of PLoRA's space
            plan = lora_sweep.plan(spec, trials, num_gpus=8)

    Args:
        space:
            The search space; None: `PLORA_SPACE` without the fields `defaults` fixes.
        points:
            Values per numeric dimension, including both ends.
        defaults:
            Fields every trial shares.

    Returns:
        The trials in grid order (the last dimension varies fastest).
    """
    space, defaults = _resolve(space, defaults)
    names = list(space)
    axes = [space[name].grid(points) for name in names]
    return [config_from_params(dict(zip(names, values)), defaults) for values in itertools.product(*axes)]


def random_configs(space: Optional[SearchSpace] = None, n: int = 10, seed: int = 0,
                   defaults: Optional[Mapping[str, Any]] = None) -> list[TrialConfig]:
    """`n` trials drawn independently from `space` (random search).

    Example:

        .. code::

            trials = random_configs(n=32, seed=0, defaults={"max_steps": 200})

    Args:
        space:
            The search space; None: `PLORA_SPACE` without the fields `defaults` fixes.
        n:
            How many trials.
        seed:
            Seeds the draws: the same seed gives the same trials.
        defaults:
            Fields every trial shares.

    Returns:
        The trials, in draw order.
    """
    space, defaults = _resolve(space, defaults)
    rng = random.Random(seed)
    return [config_from_params({name: dim.sample(rng) for name, dim in space.items()}, defaults)
            for _ in range(n)]


def _resolve(space: Optional[SearchSpace], defaults: Optional[Mapping[str, Any]]):
    defaults = dict(defaults or {})
    space = default_space(fixed=defaults) if space is None else dict(space)
    check_space(list(space), fixed=list(defaults))
    for name, dim in space.items():
        if not isinstance(dim, (Float, Int, Categorical)):
            raise TypeError(f"The dimension `{name}` is a {type(dim).__name__}, but must be a "
                            "lora_sweep.space Float, Int or Categorical.")
    return space, defaults
