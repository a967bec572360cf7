"""The nanoGPT ports (docs/porting.md).

examples/nanogpt_port.py, DSpark's own nanoGPT-style program: the checker passes it and catches a kept
division; on two ranks it trains and its checkpoint resumes on one, where its evaluation gives the
same losses at the same weights. examples/nanogpt_train/: the edit scripts that port nanoGPT's real
train.py, which DSpark does not keep: the lines they change are counted from the scripts alone, always;
with ``NANOGPT_DIR`` naming a nanoGPT checkout (commit 3adf61e1), the ports are written, diffed,
checked and run as well."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark.check import check_source
from tests.examples.test_examples import EXAMPLES, _dspark_run
from tests.messages import assert_names

PORT = EXAMPLES / "nanogpt_port.py"
RECIPES = EXAMPLES / "nanogpt_train"
PORTING_MD = EXAMPLES.parent / "docs" / "porting.md"
TINY = ("--eval_interval", "5", "--eval_iters", "2", "--gradient_accumulation_steps", "2", "--batch_size", "4",
        "--block_size", "32")


def _port_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RECIPES / "port.py"), *args], capture_output=True, text=True,
                          timeout=60)


def _stated_count(port: str) -> int:
    """The count docs/porting.md states for a port, in its table of the two."""
    found = re.search(rf"\| `{port}.ed` \| (\d+) \|", PORTING_MD.read_text())
    assert found, f"docs/porting.md states no count for {port}.ed"
    return int(found.group(1))


@pytest.mark.parametrize("port", ["minimal", "exact"])
def test_the_edit_scripts_change_what_porting_md_states(port: str) -> None:
    done = _port_tool(port, "--count")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == _stated_count(port)
    assert _stated_count("minimal") <= 40


def test_the_port_tool_names_a_file_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    for given in (tmp_path / "missing.py", tmp_path):   # no such file; a directory (the checkout)
        done = _port_tool("minimal", str(given))
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert_names(done.stderr, repr(str(given)), "train.py")


def test_the_checker_passes_the_port_and_catches_the_kept_division() -> None:
    port = PORT.read_text()
    assert check_source(port, str(PORT)) == []
    kept = port.replace("        logits, loss = model(X, Y)\n        model.backward(loss)",
                        "        logits, loss = model(X, Y)\n"
                        "        loss = loss / accum\n        model.backward(loss)")
    assert kept != port
    assert [f.code for f in check_source(kept, "train.py")] == ["DSP008"]


def _losses(out: str) -> dict[int, tuple[float, float]]:
    return {int(step): (float(train), float(val))
            for step, train, val in re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", out)}


@pytest.mark.slow
def test_the_port_trains_on_two_ranks_and_resumes_on_one_with_the_same_evaluation(tmp_path: Path) -> None:
    out = _dspark_run(tmp_path, str(PORT), "--out_dir", "run", "--max_iters", "10", *TINY)
    losses = _losses(out)
    assert sorted(losses) == [0, 5, 10] and losses[10][1] < losses[0][1] - 0.3, out
    assert "tokens per step: 256" in out and out.count("saving checkpoint") == 2
    assert (tmp_path / "run" / "scalars.csv").read_text().count("val/loss") == 3
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "run").iterdir())
    resumed = _dspark_run(tmp_path, str(PORT), "--out_dir", "run", "--max_iters", "12", "--init_from", "resume",
                          *TINY, nproc=1)
    assert "iter 10:" in resumed and "iter 12:" in resumed and "iter 9:" not in resumed, resumed
    # the weights of step 10, evaluated by 2 ranks and then by 1: the same windows, the same losses
    assert _losses(resumed)[10] == losses[10], (out, resumed)


def _nanogpt_dir() -> Path:
    where = os.environ.get("NANOGPT_DIR")
    if not where or not (Path(where) / "train.py").is_file():
        pytest.skip("set NANOGPT_DIR to a checkout of github.com/karpathy/nanoGPT (commit 3adf61e1)")
    return Path(where)


def _write_port(port: str, out: Path) -> Path:
    done = _port_tool(port, str(_nanogpt_dir() / "train.py"))
    assert done.returncode == 0, done.stderr
    out.write_text(done.stdout)
    return out


@pytest.mark.parametrize("port", ["minimal", "exact"])
def test_the_ports_of_nanogpts_train_py(tmp_path: Path, port: str) -> None:
    written = _write_port(port, tmp_path / "train.py")
    assert check_source(written.read_text(), str(written)) == []
    if shutil.which("diff"):
        diff = subprocess.run(["diff", str(_nanogpt_dir() / "train.py"), str(written)], capture_output=True, text=True)
        assert sum(line[:1] in "<>" and line != "" for line in diff.stdout.splitlines()) == _stated_count(port)


def _tiny_nanogpt(tmp_path: Path, port: str) -> Path:
    """The port beside nanoGPT's model.py and configurator.py, and a tiny tokenised text."""
    source = _nanogpt_dir()
    for name in ("model.py", "configurator.py"):
        shutil.copy(source / name, tmp_path / name)
    _write_port(port, tmp_path / "train.py")
    data = tmp_path / "data" / "tiny"
    data.mkdir(parents=True)
    tokens = np.tile(np.arange(65, dtype=np.uint16), 300)  # a pattern a small GPT learns in a few steps
    tokens[np.random.default_rng(0).random(tokens.shape) < 0.1] = 7
    tokens[:17000].tofile(data / "train.bin")
    tokens[17000:].tofile(data / "val.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    return tmp_path / "train.py"


NANOGPT_TINY = ("--dataset=tiny", "--device=cpu", "--compile=False", "--dtype=float32", "--batch_size=4",
                "--block_size=32", "--n_layer=2", "--n_head=2", "--n_embd=32", "--eval_interval=5",
                "--eval_iters=2", "--gradient_accumulation_steps=4", "--warmup_iters=2", "--lr_decay_iters=10",
                "--learning_rate=3e-3", "--max_iters=10")


@pytest.mark.slow
def test_the_exact_port_evaluates_alike_on_one_and_two_ranks_and_the_minimal_one_trains(tmp_path: Path) -> None:
    exact = _tiny_nanogpt(tmp_path, "exact")
    two = _losses(_dspark_run(tmp_path, str(exact), *NANOGPT_TINY, "--out_dir=two", "--strategy=zero2"))
    one = _losses(_dspark_run(tmp_path, str(exact), *NANOGPT_TINY, "--out_dir=one", nproc=1))
    assert sorted(two) == [0, 5, 10] and two == one
    (tmp_path / "minimal").mkdir()
    minimal = _tiny_nanogpt(tmp_path / "minimal", "minimal")
    losses = _losses(_dspark_run(tmp_path / "minimal", str(minimal), *NANOGPT_TINY, "--out_dir=run"))
    assert losses[10][1] < losses[0][1] - 0.3, losses
