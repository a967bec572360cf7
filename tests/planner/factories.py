"""A model factory for ``dspark plan --model tests.planner.factories:small_mlp``."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from tests.planner.test_planner import _batch, _mlp


def small_mlp() -> tuple[Any, Any, Any]:
    return _mlp(), _batch(), F.cross_entropy


def not_a_pair() -> int:
    return 3
