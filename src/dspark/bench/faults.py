"""Faults the lab injects on purpose into its own measurements, to test its rules.

[Note: injected faults]
A measurement taken with a fault injected (a rank slowed by ``DSPARK_BENCH_SLOW_RANK``, or any
variable named in :data:`INJECTIONS` or starting with :data:`INJECTION_PREFIX`) is not a
measurement of DSpark: it is recorded with the variables that injected it
(``Measurement.injected_faults``), every table shows it, and it never becomes evidence about the
machine or the code: :class:`dspark.bench.analyse.noise.NoiseModel` leaves it out of the run-to-run
history and :meth:`dspark.bench.ledger.ledger.Ledger.previous` never returns it as a regression baseline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["INJECTIONS", "INJECTION_PREFIX", "describe_injected", "injected_faults", "is_injected"]

INJECTION_PREFIX = "DSPARK_BENCH_INJECT_"
"""Any variable with this prefix counts as an injected fault (for injections yet to come)."""

INJECTIONS: dict[str, str] = {
    "DSPARK_BENCH_SLOW_RANK": "a rank sleeps in every forward (RANK:MS)",
}
"""The injection variables the lab knows, with what each does."""


def injected_faults(environ: Mapping[str, str]) -> dict[str, str]:
    """The injection variables set (non-empty) in ``environ``.

    Example::

        injected_faults({"DSPARK_BENCH_SLOW_RANK": "1:100"})   # {"DSPARK_BENCH_SLOW_RANK": "1:100"}
    """
    return {name: value for name, value in sorted(environ.items())
            if value and (name in INJECTIONS or name.startswith(INJECTION_PREFIX))}


def is_injected(item: Any) -> bool:
    """Whether a measurement or result carries an injected fault."""
    return bool(getattr(item, "injected_faults", None))


def describe_injected(item: Any) -> str:
    """``"injected DSPARK_BENCH_SLOW_RANK=1:100"`` (several joined by ", "), or "" when none."""
    faults = getattr(item, "injected_faults", None) or {}
    return ", ".join(f"injected {name}={value}" for name, value in sorted(faults.items()))
