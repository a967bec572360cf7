"""What the training core hands the benchmark lab beyond its public API: the one module through which
``dspark.bench`` and the scripts in ``benchmarks/`` reach anything of the engine, the planner, the
policies, comm, tensor or checkpoint that is not a public name of its package.

[Note: the lab's one door]
The lab measures the engine as a user runs it (``dspark.Engine``, ``dspark.plan``, the public names
of each package), and it needs a little more: the rules the engine runs (to say what a result
should have held), the measures the planner and the engine share (a step's tensor peak, a link's
cost, the bytes on the wire), and, for a few benchmark scripts, one piece of the engine timed alone.
Each such name is re-exported here, grouped by what the lab does with it, so that what the lab
depends on is one list: a rename inside the core breaks this file, not the lab, and
``tests/test_layering.py`` fails on any other import of the core's insides from ``dspark/bench/`` or
``benchmarks/``. Nothing here is for training scripts: they use the public API.

What the lab does with each:

* the rules the engine runs, which results are held to (what a rank should hold, the hybrid
  strategies and their shard groups, a precision's dtypes, zero3's units, the optimizer kernel the
  engine and the peers pick): ``expected_state_bytes``, ``optimizer_state_elements``,
  ``HYBRID_STRATEGIES``, ``group_layout``, ``precision_policy``, ``unit_modules``, ``kernel_name``,
  ``prefer_fused_kernel`` (``STRATEGIES``, ``PRECISIONS`` and ``PrecisionPolicy`` are public names
  of :mod:`dspark.engine`);
* the measures the planner and the lab share: a step's tensor peak (``measure_peak_bytes``,
  ``held_tensor_bytes``, ``peak_of_running_sum``), a process's memory now and at its high water
  (``process_bytes``, ``high_water_bytes``), what auto's probe is predicted to add (``probe_need``), a
  link's cost (``measure_link``), a hybrid row's groups (``hybrid_group``), what a row
  needs against a budget (``needed_bytes``),
  the bytes tensors hold (``storage_bytes``) and a collective puts on the wire (``wire_bytes``), a
  batch's leaves and fingerprints (``batch_leaves``, ``batch_fingerprint``, ``identical_ranks``);
* pieces of the engine timed alone by a benchmark script: the step observer and a forward's recorded
  inputs (``engine_parts``, ``StepObserver``, ``ForwardInputs``: observe_overhead.py), the fused
  non-finite check (``new_flag``, ``scale_and_check``: nonfinite_check_cost.py), the checks of DDP
  habits (``accum_scaling``, ``hyperparameter_fingerprint``, ``ShardedGradMarks``:
  ddp_habit_checks.py), the reduction path per backend (``SHARDED_REDUCE``: reduce_scatter.py
  sets an entry), the shared-memory transport's switch (``SHM_ENV``), a checkpoint's manifest and
  digests (``MANIFEST_FILE``, ``checkpoint_digest``: ckpt_verify_cost.py writes twins of one
  checkpoint).

Example::

    from dspark.engine.for_the_lab import expected_state_bytes, measure_peak_bytes
"""

from __future__ import annotations

from dspark.checkpoint import digest as checkpoint_digest
from dspark.checkpoint.manifest import MANIFEST_FILE
from dspark.comm.shm_transport import SHM_ENV
from dspark.comm.stats import wire_bytes
from dspark.engine.build import SHARDED_REDUCE
from dspark.engine.engine import engine_parts
from dspark.engine.finite_check import new_flag, scale_and_check
from dspark.engine.hyperparams import fingerprint as hyperparameter_fingerprint
from dspark.engine.inputs import ForwardInputs
from dspark.engine.loss_graph import accum_scaling
from dspark.engine.sharded_grad import ShardedGradMarks
from dspark.engine.step_observer import StepObserver
from dspark.planner.hybrid_rows import hybrid_group
from dspark.planner.link_probe import measure_link
from dspark.planner.peak_memory import held_tensor_bytes, measure_peak_bytes, peak_of_running_sum
from dspark.planner.probe_budget import probe_need
from dspark.planner.process_memory import high_water_bytes, process_bytes
from dspark.planner.table import needed_bytes
from dspark.policy import (
    HYBRID_STRATEGIES,
    expected_state_bytes,
    group_layout,
    kernel_name,
    optimizer_state_elements,
    precision_policy,
    prefer_fused_kernel,
    unit_modules,
)
from dspark.tensor.batch import batch_leaves
from dspark.tensor.fingerprint import batch_fingerprint, identical_ranks
from dspark.tensor.storage import storage_bytes

__all__ = [
    "HYBRID_STRATEGIES",
    "MANIFEST_FILE",
    "SHARDED_REDUCE",
    "SHM_ENV",
    "ForwardInputs",
    "ShardedGradMarks",
    "StepObserver",
    "accum_scaling",
    "batch_fingerprint",
    "batch_leaves",
    "checkpoint_digest",
    "engine_parts",
    "expected_state_bytes",
    "group_layout",
    "held_tensor_bytes",
    "high_water_bytes",
    "hybrid_group",
    "hyperparameter_fingerprint",
    "identical_ranks",
    "kernel_name",
    "measure_link",
    "measure_peak_bytes",
    "needed_bytes",
    "new_flag",
    "optimizer_state_elements",
    "peak_of_running_sum",
    "precision_policy",
    "prefer_fused_kernel",
    "probe_need",
    "process_bytes",
    "scale_and_check",
    "storage_bytes",
    "unit_modules",
    "wire_bytes",
]
