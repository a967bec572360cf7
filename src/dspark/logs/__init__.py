"""Where a job's output goes: a print on rank 0 (or every rank, prefixed), the job's log directory,
scalar trackers written from rank 0 (CSV and JSONL always; TensorBoard, W&B, MLflow), and a rank-0
progress bar.

Example::

    dspark.print(f"step {step}: loss {loss:.4f}")            # once, from rank 0
    with dspark.Tracker("runs/gpt") as tracker:
        tracker.log({"loss": loss}, step=step)
"""

from dspark.logs.console import LOG_DIR_ENV, log_dir, rank_print
from dspark.logs.progress import progress
from dspark.logs.tracker import Tracker

__all__ = ["LOG_DIR_ENV", "Tracker", "log_dir", "progress", "rank_print"]
