"""`import dspark` pays only for what every process needs: PyTorch's distributed checkpoint (DCP,
1-2 s with the DTensor machinery behind it) is imported when a checkpoint is saved or loaded, and the
benchmark lab (with matplotlib and SQLite, `dspark[lab]`) never by a training run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def _loaded_after(code: str) -> list[str]:
    probe = (f"import json, sys\n{code}\n"
             f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_dspark_leaves_dcp_out() -> None:
    assert _loaded_after("import dspark") == []


def test_a_checkpoint_function_brings_dcp_in() -> None:
    assert _loaded_after("import dspark\nfrom dspark.checkpoint import save_checkpoint") == sorted(HEAVY)
    assert _loaded_after("import dspark\ndspark.checkpoint.load_checkpoint") == sorted(HEAVY)


def test_dspark_run_starts_without_importing_torch() -> None:
    # `dspark run` is in this package: what it imports, every job pays before PyTorch's launcher
    # (which imports torch itself) even starts ([Note: a lazy package] in dspark/__init__.py)
    code = ("from dspark.cli.main import main\n"
            "main(['run', '--dry-run', '--nproc', '1', '-m', 'some.module'])")
    probe = f"import sys\n{code}\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


def test_import_dspark_imports_no_torch_and_names_resolve_on_use() -> None:
    assert _loaded_after("import dspark\nassert 'torch' not in sys.modules") == []
    probe = ("import dspark, dspark.planner\n"
             "assert dspark.Engine.__name__ == 'Engine' and dspark.plan is dspark.planner.plan\n"
             "assert dspark.print.__name__ == 'rank_print' and dspark.checkpoint.__name__ == 'dspark.checkpoint'\n"
             "from dspark import *\nassert Shard(0).dim == 0")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


@pytest.mark.slow
def test_a_training_run_imports_neither_the_lab_nor_its_dependencies() -> None:
    # the training core installs without dspark[lab]: building and stepping an engine (and letting
    # strategy="auto" plan) must not import the lab, matplotlib or SQLite
    probe = ("import dspark, functools, sys, torch\n"
             "dspark.init()\n"
             "for strategy in ('replicate', 'auto'):\n"
             "    engine = dspark.Engine(torch.nn.Linear(8, 2), strategy=strategy,\n"
             "                           optimizer=functools.partial(torch.optim.SGD, lr=0.1))\n"
             "    engine.backward(engine(torch.randn(4, 8)).square().mean())\n"
             "    engine.step()\n"
             "print('matplotlib' in sys.modules, 'sqlite3' in sys.modules,\n"
             "      any(m == 'dspark.bench' or m.startswith('dspark.bench.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.strip().splitlines()[-1] == "False False False", out.stdout + out.stderr
