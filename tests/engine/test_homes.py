"""Where each engine module's tests live: ``tests/engine/test_<module>.py``, or the files named in
:data:`HOMES` for a module whose behaviour is tested through the engine (CONTRIBUTING, "Tests"). A
new module without either, a home that names a missing file, or a home kept for a module that is gone
or that now has its own file fails here."""

from __future__ import annotations

from pathlib import Path

import dspark

SRC = Path(dspark.__file__).resolve().parent / "engine"
TESTS = Path(__file__).resolve().parents[1]

HOMES: dict[str, tuple[str, ...]] = {
    "adapters": ("engine/test_peft.py",),
    "auto_strategy": ("planner/test_auto.py", "planner/test_auto_batch.py"),
    "backward": ("engine/test_parity.py", "engine/test_uneven_batches.py", "engine/test_ranks_in_step.py"),
    "buffer_sync": ("engine/test_batchnorm.py", "engine/test_safety.py"),
    "build": ("engine/test_safety.py", "engine/test_training_loops.py", "engine/test_rank_disagreement.py"),
    "clocks": ("engine/test_step_stats.py", "engine/test_observe_gpu.py"),
    "config_docs": ("engine/test_config.py",),  # the options table it generates, against docs/engine.md
    "engine": ("engine/test_parity.py", "engine/test_modes.py", "engine/test_single_process.py"),
    "failure_agreement": ("engine/test_rank_disagreement.py",),
    "finite_check": ("engine/test_nonfinite.py", "engine/test_fp16.py"),
    "for_the_lab": ("test_layering.py",),  # what it holds is checked against what the lab imports
    "global_batchnorm": ("engine/test_batchnorm.py",),
    "grad_bucket": ("engine/test_communication.py", "engine/test_mixed_dtypes.py",
                    "engine/test_rank_dependent_use.py"),
    "grad_reducer": ("engine/test_communication.py", "engine/test_parity.py", "engine/test_uneven_batches.py"),
    "host_read": ("engine/test_fp16.py", "engine/test_gpu.py"),
    "inputs": ("engine/test_audit.py", "engine/test_batch_check.py"),
    "loss_scaler": ("engine/test_fp16.py", "engine/test_fp16_headroom.py"),
    "not_a_module": ("engine/test_ddp_habits.py",),
    "optimizer_guard": ("engine/test_safety.py", "engine/test_ddp_habits.py"),
    "own_calls": ("engine/test_safety.py",),
    "param_groups": ("engine/test_training_loops.py",),
    "rank_groups": ("engine/test_hybrid.py", "engine/test_hybrid_launch.py", "policy/test_rank_groups.py"),
    "sharded_grad": ("engine/test_ddp_habits.py",),
    "step_observer": ("engine/test_step_stats.py",),
    "update": ("engine/test_nonfinite.py", "engine/test_parity.py", "engine/test_fp16.py"),
    "validation": ("engine/test_safety.py", "engine/test_rank_disagreement.py"),
    "weights": ("engine/test_pretrained.py", "engine/test_training_loops.py"),
    "zero3_gather": ("engine/test_zero3_units.py", "engine/test_ranks_in_step.py"),
    "zero3_guard": ("engine/test_safety.py",),
    "zero3_plan": ("engine/test_zero3_units.py",),
    "zero3_saved": ("engine/test_training_loops.py", "engine/test_activation_checkpointing.py"),
}
"""Engine module -> the test files that cover it, for modules without a test file of their name."""


def test_every_engine_module_has_a_home_for_its_tests() -> None:
    modules = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    own = {m for m in modules if (TESTS / "engine" / f"test_{m}.py").exists()}
    homeless = sorted(modules - own - set(HOMES))
    assert not homeless, (f"engine modules with no test file of their name and no entry in HOMES: "
                          f"{homeless}; add tests/engine/test_<module>.py or a HOMES entry")
    stale = sorted(set(HOMES) - (modules - own))
    assert not stale, f"HOMES entries for modules that are gone or have their own test file: {stale}"
    missing = sorted(f"{m}: {f}" for m, files in HOMES.items() for f in files if not (TESTS / f).exists())
    assert not missing, f"HOMES names test files that do not exist: {missing}"
