"""Every script in ``benchmarks/`` runs, with its smallest arguments, in one launch of two ranks
(see [Note: scripts in one launch] in tests/benchmarks/script_runner.py): a script that no longer
runs against the code it measures fails here, not the day its figure is re-recorded. A new script
needs its entry in :data:`SMOKE`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dspark.bench.artifacts.table import load_table
from tests.bench.factory import make_result

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("script_runner.py")
TINY_GPT2 = ("--layers", "1", "--width", "64")


@dataclass(frozen=True)
class Smoke:
    """How the smoke test runs one script: ``python benchmarks/SCRIPT.py ARGS``, where ``{tmp}`` is
    a fresh folder of its own, ``{out}`` where its table goes, ``{shared}`` a folder every script sees."""

    args: tuple[str, ...]
    where: str = "both"
    """``both``: on both ranks, in one process group; ``rank0`` or ``rank1``: in one process (DSpark's
    world of one), that rank's, after the two-rank scripts (the long ones shared out evenly: the launch
    lasts as long as the slower rank's list, and rank 0 also writes the ``first`` weights);
    ``first``: in one process on rank 0 before the two-rank scripts (what they read)."""
    script: str = ""
    """The script, when it is not the entry's name (a script run twice)."""
    table: bool = True
    """It writes ``{out}/table.json``."""


SMOKE: dict[str, Smoke] = {
    # on both ranks, one process group each
    "async_save_vs_dcp": Smoke(("--ckpt", "{tmp}/ckpt", "--params-m", "0.02", "--saves", "1",
                                "--steps-between", "1", "--batch", "4", "--out", "{out}")),
    "batch_check_cost": Smoke(("--workload", "gpt2-cpu", "--global-batch", "2", "--steps", "1",
                               "--warmup", "0", "--out", "{out}")),
    "bucket_size": Smoke(("--workload", "gpt2-cpu", "--precision", "fp32", "--global-batch", "2",
                          "--sizes", "1,4",
                          "--steps", "1", "--rounds", "1"), table=False),
    "ddp_habit_checks": Smoke(("--runs", "gpt2-cpu:zero2", "--steps", "1", "--warmup", "0",
                               "--repeats", "1", "--out", "{out}")),
    "hybrid_two_nodes --worker": Smoke(("--worker", "hybrid-zero2", "1", "--global-batch", "2"),
                                       script="hybrid_two_nodes",
                                       table=False),
    "hybrid_two_nodes --link-worker": Smoke(("--link-worker",), script="hybrid_two_nodes",
                                            table=False),
    "heap_ratchet --worker": Smoke(("--worker", "embed-tied", "zero3", "4", "on", "tiny", "1"),
                                   script="heap_ratchet", table=False),
    "meta_zero3_rss": Smoke(("--layers", "2", "--width", "64", "--steps", "1", "--out", "{out}")),
    "nonfinite_check_cost": Smoke(("--workload", "gpt2-cpu", "--precision", "fp32", "--global-batch", "2",
                                   "--strategies", "replicate,zero2", "--steps", "1", "--warmup", "0",
                                   "--out", "{out}")),
    "observe_overhead": Smoke(("--workload", "tiny", "--strategy", "zero2", "--steps", "4",
                               "--out", "{out}")),
    "auto_budget --worker": Smoke(("--worker", "mlp-wide", str(64 * 2**30), "1"), script="auto_budget",
                                  table=False),
    "plan_validation --worker": Smoke(("--worker", "mlp-wide", "fp32", "zero2", "1", "tiny"),
                                      script="plan_validation", table=False),
    "plan_validation --link-worker": Smoke(("--link-worker",), script="plan_validation", table=False),
    "probe_rise --worker": Smoke(("--worker", "mlp-wide", "tiny", "2"), where="rank0", script="probe_rise",
                                 table=False),
    "pretrained_load_rss": Smoke(("--weights", "{shared}/gpt2", "--method", "load_pretrained",
                                  *TINY_GPT2), table=False),
    "process_peak_rss": Smoke(("--weights", "{shared}/gpt2-peak", "--path", "documented",
                               *TINY_GPT2), table=False),
    "reduce_scatter": Smoke(("--sizes", "0.01", "--repeats", "1", "--workload", "gpt2-cpu",
                             "--global-batch", "2", "--strategies", "zero2", "--steps", "1", "--rounds", "1",
                             "--out", "{out}")),
    "save_stall": Smoke(("--ckpt", "{tmp}/ckpt", "--params-m", "0.02", "--saves", "1",
                         "--steps-between", "1", "--batch", "4", "--out", "{out}")),
    "shm_collectives": Smoke(("--sizes", "0.01", "--repeats", "1", "--out", "{out}")),
    "side_by_side": Smoke(("--workload", "gpt2-cpu", "--pairs", "replicate:torch-ddp",
                           "--global-batch", "2", "--steps", "2", "--warmup", "2", "--out", "{out}")),
    "step_guard_cost": Smoke(("--workload", "tiny", "--steps", "1", "--warmup", "0", "--out", "{out}")),
    "zero3_gather": Smoke(("--workload", "gpt2-cpu", "--repeats", "1", "--rounds", "1"), table=False),
    "zero3_units": Smoke(("--workload", "resnet50-cpu", "--global-batch", "2", "--steps", "1",
                          "--rounds", "1"), table=False),
    # weights the two-rank runs above read, written first
    "pretrained_load_rss --prepare": Smoke(("--prepare", "{shared}/gpt2", *TINY_GPT2), where="first",
                                           script="pretrained_load_rss", table=False),
    "process_peak_rss --prepare": Smoke(("--prepare", "{shared}/gpt2-peak", *TINY_GPT2), where="first",
                                        script="process_peak_rss", table=False),
    # in one process each, on the rank named
    "check_scaling": Smoke(("--lines", "20", "--mb", "--out", "{out}"), where="rank1"),
    "ckpt_verify_cost": Smoke(("--gb", "0.001", "--width", "64", "--repeats", "1", "--dir", "{tmp}",
                               "--out", "{out}"), where="rank1"),
    "cpu_malloc": Smoke(("--choices", "tuned", "--workload", "gpt2-cpu", "--batch", "1",
                         "--precision", "fp32", "--rounds", "1", "--warmup", "0", "--steps", "1",
                         "--out", "{out}"), where="rank1"),
    "examples_on_real_data": Smoke(("--nproc", "1", "--char-gpt-steps", "2", "--digits-epochs", "1",
                                    "--out", "{out}"), where="rank0"),
    "one_device_vs_pytorch": Smoke(("--workloads", "gpt2-cpu", "--global-batch", "2",
                                    "--micro-batch", "gpt2-cpu=2", "--precision", "fp32",
                                    "--rounds", "1", "--steps", "1", "--warmup", "0"),
                                   where="rank1", table=False),
    "optimizer_kernel": Smoke(("--params-m", "0.01", "--tensors", "4", "--steps", "1", "--repeats", "1",
                               "--out", "{out}"), where="rank0"),
    "peer_ratios": Smoke(("{shared}/peers.json",), where="rank0", table=False),
    "plan_at_scale": Smoke(("--out", "{out}"), where="rank0"),
    "probe_stability": Smoke(("--models", "mlp-deep", "--size", "tiny", "--repeats", "1", "--no-hog",
                              "--out", "{out}"), where="rank1"),
    "restart_time": Smoke(("--kills", "1", "--save-every", "1", "--step-sleep", "0", "--out", "{out}"),
                          where="rank1"),
    "startup_time": Smoke(("--repeats", "1", "--nproc", "1", "--out", "{out}"), where="rank1"),
    "zero_real_memory": Smoke(("--strategies", "replicate", "--nproc", "1", "--width", "256", "--out", "{out}"),
                              where="rank0"),
}


def _peers_results() -> list[dict[str, Any]]:
    """A peers run in miniature: DSpark's replicate and DDP on 2 devices, with their baseline."""
    return [dataclasses.asdict(make_result(num_devices=n, strategy=s, run_id="peers"))
            for n, s in ((1, "replicate"), (2, "replicate"), (2, "torch-ddp"))]


@dataclass(frozen=True)
class Ran:
    results: Path
    out: Path
    seconds: float


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    base = tmp_path_factory.mktemp("scripts")
    results, out, shared = base / "results", base / "out", base / "shared"
    for folder in (results, out, shared):
        folder.mkdir()
    (shared / "peers.json").write_text(json.dumps(_peers_results()))

    def entry(name: str, smoke: Smoke) -> dict[str, Any]:
        (base / "tmp" / name).mkdir(parents=True)
        places = {"tmp": base / "tmp" / name, "out": out / name, "shared": shared}
        return {"name": name, "script": smoke.script or name,
                "args": [arg.format(**places) for arg in smoke.args]}

    plan = {where: [entry(name, s) for name, s in SMOKE.items() if s.where == where]
            for where in ("first", "both", "rank0", "rank1")}
    (base / "plan.json").write_text(json.dumps(plan))
    common = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    ranks = [subprocess.Popen([sys.executable, str(RUNNER), str(base / "plan.json"), str(results)],
                              env={**common, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outputs = [rank.communicate(timeout=600)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), "\n".join(o[-5000:] for o in outputs)
    return Ran(results=results, out=out, seconds=time.perf_counter() - started)


def test_every_script_has_a_smoke_run() -> None:
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
    smoked = {smoke.script or name for name, smoke in SMOKE.items()}
    assert scripts - smoked == set(), "add each new script to SMOKE with its smallest arguments"
    assert smoked - scripts == set(), "SMOKE names scripts that are gone"


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one waits for the launch
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_script_runs(ran: Ran, name: str) -> None:
    smoke = SMOKE[name]
    ranks = [0, 1] if smoke.where == "both" else [1] if smoke.where == "rank1" else [0]
    outcomes = [json.loads(path.read_text()) for path in sorted(ran.results.glob(f"{name}.rank*.json"))]
    assert [outcome["rank"] for outcome in outcomes] == ranks, f"{name} did not run on ranks {ranks}"
    for outcome in outcomes:
        log = (ran.results / f"{name}.rank{outcome['rank']}.txt").read_text()
        assert outcome["ok"], f"{name} on rank {outcome['rank']}:\n{outcome['error']}\n{log[-3000:]}"
    if smoke.table:
        assert load_table(ran.out / name / "table.json").rows, f"{name} wrote an empty table"


@pytest.mark.slow
def test_optimizer_kernel_writes_the_table_it_prints(ran: Ran) -> None:
    table = load_table(ran.out / "optimizer_kernel" / "table.json")
    printed = (ran.results / "optimizer_kernel.rank0.txt").read_text()
    assert [row[0] for row in table.rows] == ["for-loop", "foreach", "fused"]
    for name, step_ms, speed in table.rows:
        assert f"{name:9s} {step_ms:>7} ms  ({speed.removesuffix('x')}x the loop)" in printed
    assert "4 tensors" in table.caption and "median of 1 repeats" in table.caption
