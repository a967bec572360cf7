"""Every subcommand, given bad input (a damaged or crafted checkpoint, a path that is no file, a bad
value) or a full disk, ends in one line naming the input and a non-zero exit code, never a
traceback, and leaves nothing half-written.

The commands run in this process through ``dspark.cli.main.main`` (what the ``dspark`` script
calls), all of them in one test against one saved checkpoint; the full disk (a file size limit, as
``ulimit -f`` sets) runs the ``dspark`` script itself in a shell, once.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dspark
from dspark.cli.main import main
from tests.engine import tiny_models as tm


def _save(directory: Path, width: int | None = None) -> Path:
    """A one-rank checkpoint of the tiny MLP, or of ``width`` x ``width`` layers (bigger files)."""
    model = tm.make("mlp") if width is None else torch.nn.Sequential(*(torch.nn.Linear(width, width)
                                                                       for _ in range(3)))
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    if width is None:
        x, y = tm.batch("mlp", 8, 0)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
    else:
        engine.backward(engine(torch.randn(4, width)).square().mean())
    engine.step()
    engine.save(directory)
    engine.close()
    return directory


def _damaged(good: Path, name: str, content: bytes | None = None, size_bytes: int | None = None) -> Path:
    """A copy of ``good`` with file ``name`` replaced (by ``content``, or a sparse ``size_bytes``)."""
    copy = good.parent / f"{good.name}-{name.strip('.').replace('.', '-')}-{size_bytes or len(content or b'')}"
    shutil.copytree(good, copy)
    if size_bytes is not None:
        with open(copy / name, "wb") as out:
            out.truncate(size_bytes)
    else:
        (copy / name).write_bytes(content or b"")
    return copy


def _cases(tmp: Path) -> list[tuple[list[str], list[str]]]:
    """``(argv, what the message must name)`` per bad input."""
    good = _save(tmp / "ckpt")
    a_file = tmp / "notes.txt"
    a_file.write_text("not a checkpoint\n")
    no_manifest = _damaged(good, "manifest.json")
    (no_manifest / "manifest.json").unlink()
    big_manifest = _damaged(good, "manifest.json", size_bytes=200 * 2**20)
    garbage_info = _damaged(good, "dspark.json", b"garbage")
    deep_state = _damaged(good, "training_state.json", b"[" * 100_000 + b"]" * 100_000)
    fifo_info = _damaged(good, "dspark.json")
    (fifo_info / "dspark.json").unlink()
    os.mkfifo(fifo_info / "dspark.json")  # was "the directory has no dspark.json": not found, not damaged
    (tmp / "loop1").symlink_to(tmp / "loop2")
    (tmp / "loop2").symlink_to(tmp / "loop1")
    raising = tmp / "models.py"
    raising.write_text("import torch\nmodel = undefined_name\n")
    probe = tmp / "probe.json"
    probe.write_text('{"probe": {"device": 3}}')
    deep = tmp / "deep.py"
    deep.write_text("a = 1\nb = " + "+".join(["a"] * 25_000) + "\n")
    out = tmp / "out"
    return [
        # dspark ckpt info / verify / export
        (["ckpt", "info", str(tmp / "missing")], [str(tmp / "missing"), "does not exist"]),
        (["ckpt", "info", str(a_file)], [str(a_file), "is a file"]),
        (["ckpt", "info", str(no_manifest)], [str(no_manifest), "no manifest.json"]),
        (["ckpt", "info", "--json", str(big_manifest)], ["manifest.json", f"{200 * 2**20} bytes"]),
        (["ckpt", "info", str(garbage_info)], ["dspark.json", "damaged"]),
        (["ckpt", "info", str(deep_state)], ["training_state.json"]),  # within its bounds, too deep
        (["ckpt", "info", str(fifo_info)], [str(fifo_info / "dspark.json"), "not a regular file"]),
        (["ckpt", "export", str(fifo_info), str(out)], [str(fifo_info / "dspark.json"), "not a regular file"]),
        (["ckpt", "verify", str(tmp / "missing")], [str(tmp / "missing")]),
        (["ckpt", "verify", str(big_manifest)], ["manifest.json", f"{200 * 2**20} bytes"]),
        (["ckpt", "verify", str(no_manifest)], [str(no_manifest), "no manifest.json"]),
        (["ckpt", "export", str(good), str(a_file / "out")], [str(a_file), "not a directory"]),
        (["ckpt", "export", str(good), str(a_file)], [str(a_file), "is a file"]),
        (["ckpt", "export", str(good), str(out), "--dtype", "int4"], ["'int4'"]),
        (["ckpt", "export", str(good), str(out), "--max-shard-size", "5XB"], ["'5XB'"]),
        (["ckpt", "export", str(big_manifest), str(out)], ["manifest.json", "bytes"]),
        (["ckpt", "frob", str(good)], ["'frob'"]),
        # dspark plan
        (["plan", "--workload", "nope"], ["'nope'"]),
        (["plan", "--model", "no_such_module:build"], ["no_such_module:build"]),
        (["plan", "--model", f"{raising}:build"], [f"{raising}:build", "NameError", "line 2"]),
        (["plan", "--workload", "gpt2-cpu", "--probe", str(tmp / "missing.json")], ["missing.json"]),
        (["plan", "--workload", "gpt2-cpu", "--probe", str(a_file)], [str(a_file)]),
        (["plan", "--workload", "gpt2-cpu", "--probe", str(probe)], [str(probe)]),
        (["plan", "--workload", "gpt2-cpu", "--devices", "two"], ["'two'"]),
        (["plan", "--model", "tests.planner.factories:small_mlp", "--devices", "1,2", "--trace", "fake",
          "--plot", str(out)], ["--trace fake", "--trace measure"]),  # was a ZeroDivisionError traceback
        (["plan", "--workload", "gpt2-cpu", "--memory-budget", "lots"], ["'lots'"]),
        # dspark check
        (["check", str(tmp / "missing.py")], ["missing.py", "does not exist"]),
        (["check", str(tmp / "loop1")], [str(tmp / "loop1"), "symbolic link loop"]),
        (["check", str(a_file / "x.py")], [str(a_file / "x.py")]),
        (["check", "/dev/zero"], ["/dev/zero", "a device"]),
        (["check", str(deep)], [str(deep), "DSP000", "cannot analyse"]),
        # dspark env
        (["env", "--nnodes", "0"], ["--nnodes=0"]),
        (["env", "--nnodes", "two"], ["'two'"]),
        # dspark bench (not the ledger's own subcommands)
        (["bench", "--suite", "nope"], ["'nope'"]),
        (["bench", "--workloads", "nope", "--devices", "1"], ["'nope'"]),
        (["bench", "--devices", "0"], ["devices=[0]"]),
        (["bench", "--strategies", "foo", "--devices", "1"], ["'foo'"]),
        (["bench", "--rounds", "0"], ["'0'", "--rounds"]),
        (["bench", "list", "--db", str(a_file)], [str(a_file), "not a DSpark ledger"]),
        (["bench", "list", "--db", str(tmp)], [str(tmp), "is a directory"]),
        (["bench", "compare", "a", "b", "--db", str(tmp / "none" / "x.sqlite")], ["x.sqlite"]),
        (["bench", "report", "--report", str(a_file / "r")], [str(a_file)]),
        (["bench", "export", "--json", str(a_file / "x.json")], [str(a_file)]),
        (["bench", "rerun"], ["--stale"]),
        # dspark run: bad arguments (refused before anything starts)
        (["run", "--nproc", "0", str(a_file)], ["--nproc 0"]),
        (["run", "--nproc", "2"], ["no script given"]),
        (["run", "--nproc", "2", str(tmp / "missing.py")], ["missing.py"]),
        (["run", "--nproc", "2", "--master-port", "99999", str(a_file)], ["--master-port 99999"]),
        (["run", "--nproc", "2", "--grace-period", "-1", str(a_file)], ["--grace-period -1"]),
    ]


def test_bad_input_to_any_subcommand_is_one_line_naming_it(
        single_process: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = _cases(tmp_path)
    capsys.readouterr()
    wrong = []
    for argv, names in cases:
        code = main(argv)
        out, err = capsys.readouterr()
        said = err if err.strip() else out  # verify and check report on stdout, exit code 1
        problems = []
        if code == 0:
            problems.append("exit code 0")
        if "Traceback" in out + err:
            problems.append("a traceback")
        if err.strip() and len(err.strip().splitlines()) != 1:
            problems.append(f"{len(err.strip().splitlines())} lines on stderr")
        missing = [name for name in names if name not in said]
        if missing:
            problems.append(f"does not name {missing}")
        if problems:
            wrong.append(f"dspark {' '.join(argv)[:120]}: {', '.join(problems)}:\n  {(err or out)[:400]}")
    assert not wrong, "\n".join(wrong)
    assert not (tmp_path / "out").exists()  # nothing half-written by the refused exports


_EACH = """
import contextlib, io, json, sys
from dspark.cli.main import main
results = []
for out, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    results.append([out, code, err.getvalue()])
print(json.dumps(results))
"""


@pytest.mark.slow
def test_ckpt_export_on_a_full_disk_is_one_line_and_leaves_nothing(single_process: object,
                                                                   tmp_path: Path) -> None:
    good = _save(tmp_path / "ckpt", width=64)  # 50 KB of weights: over the 8 KB a file may have
    outs = [str(tmp_path / out) for out in ("hf", "model.safetensors", "model.pt")]
    commands = [(out, ["ckpt", "export", str(good), out, "--max-shard-size", "20KB"]) for out in outs]
    plot = str(tmp_path / "plan.png")  # a plot of some 30 KB (its error named no file before)
    commands.append((plot, ["plan", "--model", "tests.planner.factories:small_mlp", "--devices", "2",
                            "--plot", plot]))
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    done = subprocess.run([sys.executable, "-c", _EACH, json.dumps(commands)], capture_output=True,
                          text=True, timeout=120,  # ulimit -f 8: files of at most 8 KB
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard)))
    assert done.returncode == 0, done.stderr
    for out, code, err in json.loads(done.stdout):
        assert code == 1, (out, err)
        last = err.strip().splitlines()[-1]  # plan's progress lines come first
        assert "Traceback" not in err and (out == plot or len(err.strip().splitlines()) == 1), err
        assert out in last and ("ulimit -f" in last or out == plot), err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)  # nothing left behind
    assert json.loads((good / "dspark.json").read_text())["format"] == "dspark-checkpoint"
