"""The memory promise holds for the whole process: on DSpark's documented path for a pretrained
model (``meta_init()`` + ``from_config``, ``Engine(strategy="zero3")``, ``load_pretrained``), each of 2
ranks peaks (``VmHWM``: the kernel's count at the worst moment, no ``malloc_trim``) below what it held
with the libraries loaded plus one whole copy of the model. Building under ``meta_init()`` used to
leave every random initialisation's scratch tensor in glibc's heap: a GPT-2 of 130 MiB peaked 194 MiB
above the libraries before the engine existed (see [Note: one scratch buffer]). The full-size
measurement (GPT-2 medium, beside the naive path and FSDP2) is ``benchmarks/process_peak_rss.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("process_peak_worker.py")


def config() -> Any:
    """GPT-2 of 8 layers, width 512, a vocabulary of 16384: 130 MiB of fp32 parameters."""
    from transformers import GPT2Config

    return GPT2Config(n_embd=512, n_layer=8, n_head=8, vocab_size=16384, n_positions=1024,
                      bos_token_id=0, eos_token_id=0)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_the_documented_path_peaks_below_the_libraries_plus_one_model(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path / "weights")
    del model
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2", str(WORKER),
                           str(tmp_path / "weights"), str(tmp_path / "out.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for rank in json.loads((tmp_path / "out.json").read_text())["phases"]:
        peaks = dict(rank)
        libraries = peaks.pop("libraries")
        assert peaks["meta_init"] - libraries < model_bytes / 2, rank  # at most the largest tensor
        assert peaks["load_pretrained"] - libraries < model_bytes, rank
