"""The strategies every engine test covers: the engine's own table, so a new one is tested at once."""

from __future__ import annotations

from dspark.policy.strategies import STRATEGIES as _POLICIES

STRATEGIES: tuple[str, ...] = tuple(_POLICIES)
