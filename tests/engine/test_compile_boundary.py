"""The engine's hooks run eagerly under torch.compile, and importing DSpark does not load the
compiler (about a second of start-up per process, paid by every job and benchmark launch)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from dspark.engine.compile_boundary import outside_compile


def _traced_flags(wrap: bool) -> list[bool]:
    seen: list[bool] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(torch.compiler.is_compiling())

    model = nn.Linear(3, 3)
    model.register_forward_pre_hook(outside_compile(hook) if wrap else hook)
    model.compile(backend="eager")
    for step in range(2):
        model(torch.full((2, 3), float(step))).sum().backward()
    torch._dynamo.reset()
    return seen


def test_a_hook_runs_outside_the_graph_when_its_module_is_compiled() -> None:
    assert _traced_flags(wrap=False)[0] is True  # the control: dynamo traces a plain hook
    assert _traced_flags(wrap=True) == [False, False]


def test_a_hook_called_eagerly_is_the_function_itself() -> None:
    calls = []
    wrapped = outside_compile(lambda x: calls.append(x) or x + 1)
    assert wrapped(1) == 2 and calls == [1]


def test_importing_dspark_does_not_load_the_compiler() -> None:
    code = "import sys, dspark, dspark.bench.measure.worker; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
