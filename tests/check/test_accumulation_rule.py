"""DSP008 (issue 30): a loss divided by the accumulation count before engine.backward is flagged, in
nanoGPT's shape and its variants, and a correct loop is not. The 2-rank test runs the very script the
checker reads: the engine refuses the divided loss at run time too, and with that check switched off
the division costs a gradient K times too small."""

from __future__ import annotations

import runpy
import textwrap
from pathlib import Path

import pytest

from dspark.check.placement_rules import CODES, check_source
from dspark.cli.main import main

NANOGPT = """\
import dspark, functools, torch
gradient_accumulation_steps = 5 * 8
gradient_accumulation_steps //= world_size
engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=6e-4),
                       grad_accum_steps=gradient_accumulation_steps, clip_grad_norm=1.0)
while True:
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = engine(X, Y)
            loss = loss / gradient_accumulation_steps # scale the loss to account for gradient accumulation
        X, Y = get_batch('train')
        engine.backward(loss)
    engine.step()
    lossf = loss.item() * gradient_accumulation_steps
"""


def _dsp008(source: str) -> list[int]:
    return [f.line for f in check_source(textwrap.dedent(source), "train.py") if f.code == "DSP008"]


def test_the_nanogpt_line_is_flagged_where_the_fix_goes() -> None:
    findings = [f for f in check_source(NANOGPT, "train.py") if f.code == "DSP008"]
    assert [(f.line, f.severity) for f in findings] == [(10, "error")]
    assert "engine.backward() at line 12" in findings[0].message
    assert "(gradient_accumulation_steps)" in findings[0].message and "engine.backward(loss)" in findings[0].message
    assert CODES["DSP008"][0] == "error"


@pytest.mark.parametrize(("source", "lines"), [
    ("loss = model(x)\nloss /= grad_accum_steps\nengine.backward(loss)\n", [2]),
    ("loss = loss / args.gradient_accumulation_steps\nengine.backward(loss)\n", [1]),
    ("engine.backward(loss / accum_iter)\n", [1]),
    ("engine.backward((loss / cfg.accum))\n", [1]),
    ("engine.backward(loss.div(accumulation_steps))\n", [1]),
    ("engine.backward(torch.div(loss, grad_accum))\n", [1]),
    ("engine.backward(loss * (1.0 / grad_accum_steps))\n", [1]),
    ("loss = F.cross_entropy(out, y) / grad_accum_steps\nscaled = loss + 0.0\nengine.backward(scaled)\n", [1]),
    # the value passed as Engine(grad_accum_steps=...), under any name, and names assigned from it
    ("import dspark\nk = 4\ne = dspark.Engine(m, grad_accum_steps=k)\ne.backward(loss / k)\n", [4]),
    ("import dspark\nsteps = cfg.micro\nj = steps * 1\ntrainer = dspark.Engine(m, grad_accum_steps=steps)\n"
     "trainer.backward(loss / j)\n", [5]),
    ("import dspark\ne = dspark.Engine(m, grad_accum_steps=4)\ne.backward(loss / 4)\n", [3]),
    # or to the engine's config (dspark.EngineConfig, or a config's replace)
    ("import dspark\ncfg = dspark.EngineConfig(grad_accum_steps=4)\ne = dspark.Engine(m, config=cfg)\n"
     "e.backward(loss / 4)\n", [4]),
    ("from dspark import EngineConfig\nk = 8\ncfg = EngineConfig(strategy='zero2').replace(grad_accum_steps=k)\n"
     "e = dspark.Engine(m, config=cfg)\nloss = f(x) / k\ne.backward(loss)\n", [5]),
    ("class Trainer:\n    def step(self, loss):\n        loss = loss / self.grad_accum_steps\n"
     "        self.engine.backward(loss)\n", [3]),
    # in place, a power, a product with the reciprocal (issue 37)
    ("loss = model(x)\nloss.div_(gradient_accumulation_steps)\nengine.backward(loss)\n", [2]),
    ("loss = model(x)\nloss.mul_(1.0 / gradient_accumulation_steps)\nengine.backward(loss)\n", [2]),
    ("engine.backward(loss * gradient_accumulation_steps ** -1)\n", [1]),
    ("loss *= 1 / grad_accum\nengine.backward(loss)\n", [1]),
    ("engine.backward(torch.mul(loss, 1 / grad_accum_steps))\n", [1]),
    ("def train(engine):\n    for x in xs:\n        loss = f(x)\n        loss.div_(grad_accum_steps)\n"
     "        engine.backward(loss)\n", [4]),
    # a helper that divides, also through a default argument; reported where it is called
    ("def scaled(l):\n    return l / gradient_accumulation_steps\nengine.backward(scaled(loss))\n", [3]),
    ("def scaled(l):\n    return l / gradient_accumulation_steps\nloss = scaled(loss)\nengine.backward(loss)\n", [3]),
    ("def scaled(l, k=gradient_accumulation_steps):\n    return l / k\nengine.backward(scaled(loss))\n", [3]),
    ("import dspark\nK = 4\ne = dspark.Engine(m, grad_accum_steps=K)\ndef scaled(l, n=K):\n    out = l / n\n"
     "    return out\ne.backward(scaled(loss))\n", [7]),
])
def test_variants_are_flagged(source: str, lines: list[int]) -> None:
    assert _dsp008(source) == lines


@pytest.mark.parametrize("source", [
    "engine.backward(loss)\nlossf = loss.item() * gradient_accumulation_steps\n",
    "engine.backward(loss / 4)\n",                             # 4 is not the engine's count
    "loss = loss / grad_accum_steps\nloss = model(x)\nengine.backward(loss)\n",  # a new loss
    "logits, loss = model(x, y)\nengine.backward(loss, weight=n)\nprint(loss / grad_accum_steps)\n",
    "loss = loss / grad_accum_steps\nloss.backward()\n",        # plain PyTorch: its own convention
    "scaler.scale(loss / gradient_accumulation_steps).backward()\n",  # DDP's loop, not an engine
    "loss = loss / grad_accum_steps  # dspark: ignore[DSP008]\nengine.backward(loss)\n",
    "def f(loss):\n    return loss / grad_accum_steps\nengine.backward(loss)\n",  # another scope
    "def scaled(l):\n    return l * 2\nengine.backward(scaled(loss))\n",   # a helper that scales by 2
    "engine.backward(loss * 2 ** -1)\n",
    "loss.mul_(2.0)\nengine.backward(loss)\n",
])

def test_correct_loops_are_not_flagged(source: str) -> None:
    assert _dsp008(source) == []


def test_a_helpers_finding_says_what_the_helper_does() -> None:
    source = "def scaled(l, k=gradient_accumulation_steps):\n    return l / k\nengine.backward(scaled(loss))\n"
    (finding,) = check_source(source, "train.py")
    assert "scaled() at line 1 returns its argument divided by k" in finding.message, finding.message


SCRIPT = """\
import functools

import torch

import dspark

K = 4


def main() -> float:
    dspark.init()
    torch.manual_seed(0)
    engine = dspark.Engine(torch.nn.Linear(8, 1), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           grad_accum_steps=K, clip_grad_norm=1e9, allow_accum_scaled_loss={allow})
    loader = dspark.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)),
                               global_batch_size=8, seed=0)
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        loss = loss / K{ignore}
        engine.backward(loss)
        if (step + 1) % K == 0:
            engine.step()
            return float(engine.last_grad_norm)
    raise AssertionError("no step")


if __name__ == "__main__":
    main()
"""


def _run_script(path: str) -> float | str:
    try:
        return float(runpy.run_path(path)["main"]())
    except ValueError as exc:
        return str(exc)


def test_a_two_rank_run_that_divides_by_k_is_flagged(pool, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    divided = tmp_path / "divided.py"
    divided.write_text(SCRIPT.format(ignore="", allow=False))
    allowed = tmp_path / "allowed.py"
    allowed.write_text(SCRIPT.format(ignore="", allow=True))
    fixed = tmp_path / "fixed.py"
    fixed.write_text(SCRIPT.format(ignore="", allow=False).replace("        loss = loss / K\n", ""))
    # the run: the engine refuses the divided loss on every rank
    for message in pool.run(_run_script, str(divided)):
        assert "divided by grad_accum_steps=4" in str(message), message
    # with that check off, no error anywhere, and the gradient is K times too small
    small, right = pool.run(_run_script, str(allowed)), pool.run(_run_script, str(fixed))
    assert small[0] == small[1] and right[0] == right[1]
    assert right[0] == pytest.approx(4 * small[0], rel=1e-5)
    # the checker, on the same file: an error at the division, exit status 1
    assert main(["check", str(divided)]) == 1
    out = capsys.readouterr().out
    assert f"{divided}:19:" in out and "DSP008" in out and "1 error, 0 warnings" in out
    assert main(["check", str(fixed)]) == 0
    assert "no risky placements" in capsys.readouterr().out
