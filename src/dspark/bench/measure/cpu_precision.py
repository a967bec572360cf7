"""Which precision a CPU benchmark should run in: the presets' mixed precision only where this CPU
computes it faster than fp32.

The CPU presets default to bf16 autocast, chosen for cores that multiply bf16 matrices faster
than fp32 (AMX / native bf16 dot products). Other x86 cores convert bf16 in software and run it
*slower* than fp32; fp16 on CPU is slower still on most. A scaling check in mixed
precision there measures a slower program than the machine can run, for twice the minutes. The
``quick`` and ``peers`` suites therefore time a 512 x 512 matrix product in fp32 and bf16 on one
thread (the best of 8, once per suite) and keep the preset's precision only when it is faster than
fp32; ``--precision`` always wins, and the ``seed`` suite keeps the presets' (the article's table
is about mixed precision).

Example::

    choose_cpu_precision("bf16", {"fp32": 1.9, "bf16": 3.1})   # the two matmul times, ms
    # PrecisionChoice(precision='fp32', reason='bf16 matmul ... vs fp32 ... on one core')
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["PrecisionChoice", "choose_cpu_precision", "cpu_matmul_ms"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SIZE = 512
_REPEATS = 8


@dataclass(frozen=True, slots=True)
class PrecisionChoice:
    precision: str
    """fp32, bf16 or fp16."""
    reason: str
    """The timings that decided it, for the log line."""


def cpu_matmul_ms(precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> dict[str, float]:
    """Milliseconds of one 512 x 512 matrix product per precision, on one thread (the best of a few
    repeats: the fastest run is the one least disturbed).

    Example::

        cpu_matmul_ms(("fp32", "bf16"))   # {'fp32': 1.87, 'bf16': 3.15}
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a benchmark worker is one core
    try:
        out = {}
        for name in precisions:
            a = torch.randn(_SIZE, _SIZE).to(_DTYPES[name])
            b = torch.randn(_SIZE, _SIZE).to(_DTYPES[name])
            a @ b  # first call: kernel selection, page faults
            best = float("inf")
            for _ in range(_REPEATS):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            out[name] = best * 1e3
        return out
    finally:
        torch.set_num_threads(threads)


def choose_cpu_precision(preferred: str, matmul_ms: Mapping[str, float]) -> PrecisionChoice:
    """``preferred`` (a preset's precision) when it is fp32, when ``matmul_ms`` lacks a timing, or
    when this CPU multiplies in it faster than in fp32; else fp32.

    Example::

        choose_cpu_precision("bf16", {"fp32": 2.8, "bf16": 0.67}).precision   # 'bf16'
    """
    if preferred not in _DTYPES:
        raise ValueError(f"precision={preferred!r} is not one of {', '.join(_DTYPES)}")
    if preferred == "fp32" or preferred not in matmul_ms or "fp32" not in matmul_ms:
        return PrecisionChoice(preferred, "the preset's precision")
    half, full = matmul_ms[preferred], matmul_ms["fp32"]
    reason = f"{preferred} matmul {half:.2f} ms vs fp32 {full:.2f} ms on one core"
    return PrecisionChoice(preferred if half < full else "fp32", reason)
