"""Whether a result's figures agree with each other: the checks ``make figures`` runs on every row
of every artifact before it renders one.

[Note: consistent results]
A result row carries its raw figures (every timed step of every round) beside what was summarised
from them (the median and p10-p90, each round's median, samples per second) and what was analysed
from those (the speedup, its rounds' min and max, the efficiency, the anomalies). Each of the latter
is recomputed here from the former, with the lab's own code (:func:`dspark.bench.ledger.measurement.
step_time_summary`, :func:`dspark.bench.analyse.analysis.annotate`): a row whose median lies outside its
own p10-p90, or is not the median of its steps, or whose speedup is not what its rounds' steps give,
was not written by the lab as it stands, and is refused, named, with both values. The analysis
rendered is the one recomputed (the current rules), never the one a file says it had.

Rows re-derived from a kept ledger (see [Note: kept rows] in :mod:`dspark.bench.ledger.rows`) are
consistent by construction and get the same checks.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from dspark.bench.analyse.analysis import annotate
from dspark.bench.ledger.measurement import step_time_summary
from dspark.bench.result import BenchResult

__all__ = ["RELATIVE_TOLERANCE", "rederive", "row_faults"]

RELATIVE_TOLERANCE = 1e-6
"""How far a recorded figure may sit from its recomputation: JSON keeps a float exactly, so only
rounding in the last digits."""


def _name(row: dict[str, Any]) -> str:
    return (f"{row.get('workload')} on {row.get('num_devices')} device(s), {row.get('strategy')}, "
            f"batch {row.get('batch_placement')} {row.get('global_batch')}")


def _differs(recorded: Any, computed: float | None) -> bool:
    if recorded is None or computed is None:
        return (recorded is None) != (computed is None)
    return not math.isclose(float(recorded), computed, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-9)


def row_faults(row: dict[str, Any]) -> list[str]:
    """What ``row`` (a result as ``dspark bench export --json`` writes it) says that its own raw
    figures contradict, each naming the row and both values; [] when it agrees with itself.

    Example::

        row_faults({"step_ms": 517.4, "step_ms_p10": 569.1, ...})
        # ["gpt2-cpu on 1 device(s), ...: step_ms 517.4 lies outside its own p10-p90 (569.1-...)"]
    """
    name, faults = _name(row), []
    step, p10, p90 = row.get("step_ms"), row.get("step_ms_p10"), row.get("step_ms_p90")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (step, p10, p90)):
        return [f"{name}: step_ms, step_ms_p10 and step_ms_p90 must be numbers, got "
                f"{step!r}, {p10!r}, {p90!r}"]
    step, p10, p90 = float(step), float(p10), float(p90)  # type: ignore[arg-type]
    if not p10 <= step <= p90:
        faults.append(f"{name}: step_ms {step:.1f} lies outside its own p10-p90 ({p10:.1f}-{p90:.1f})")
    by_round = [list(steps) for steps in row.get("step_ms_by_round") or []]
    pooled = [float(ms) for steps in by_round for ms in steps]
    if pooled:
        for key, recorded, computed in zip(("step_ms", "step_ms_p10", "step_ms_p90"), (step, p10, p90),
                                           step_time_summary(pooled), strict=True):
            if _differs(recorded, computed):
                what = {"step_ms": "median", "step_ms_p10": "p10", "step_ms_p90": "p90"}[key]
                faults.append(f"{name}: {key} {recorded:.1f} is not the {what} of its {len(pooled)} "
                              f"timed steps ({computed:.1f})")
        medians = [statistics.median(steps) for steps in by_round if steps]
        recorded_medians = list(row.get("round_step_ms") or [])
        if len(recorded_medians) == len(medians) and any(
                _differs(r, m) for r, m in zip(recorded_medians, medians, strict=True)):
            faults.append(f"{name}: round_step_ms {[round(r, 1) for r in recorded_medians]} are not "
                          f"its rounds' median steps {[round(m, 1) for m in medians]}")
    samples = row.get("samples_per_step") or row.get("global_batch") or 0
    if row.get("samples_per_s") is not None and step > 0 and _differs(row["samples_per_s"],
                                                                     samples / (step / 1e3)):
        faults.append(f"{name}: samples_per_s {row['samples_per_s']:.1f} is not {samples} samples "
                      f"over its {step:.1f} ms step ({samples / (step / 1e3):.1f})")
    return faults


_ANALYSED = (("speedup", "the median of its rounds' ratios"), ("speedup_min", "its lowest round's ratio"),
             ("speedup_max", "its highest round's ratio"), ("efficiency", "its speedup over its devices"))


def rederive(rows: list[dict[str, Any]], *, where: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``rows`` analysed again by the current rules (speedups from their rounds' steps, anomalies),
    and every contradiction between a row and its own figures (see [Note: consistent results]);
    ``where`` names the file in the messages.

    Example::

        derived, faults = rederive(json.loads(path.read_text()), where=str(path))
    """
    try:
        results = [BenchResult.from_dict(row) for row in rows]
    except TypeError as exc:
        return [], [f"{where}: a row is not a result as `dspark bench export --json` writes it ({exc})"]
    faults = [f"{where}: {fault}" for row in rows for fault in row_faults(row)]
    derived = annotate(results)
    for row, result in zip(rows, derived, strict=True):
        for key, meaning in _ANALYSED:
            if key in row and _differs(row[key], getattr(result, key)):
                computed = getattr(result, key)
                faults.append(f"{where}: {_name(row)}: {key} {row[key]!r:.8} does not follow from its "
                              f"steps: {meaning} is {'none' if computed is None else f'{computed:.4f}'}")
    return [result.to_dict() for result in derived], faults
