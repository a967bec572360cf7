"""DSP009-DSP011 (issue 37): a clip of the module's parameters and a sharded optimizer's state dict,
kept from a DDP loop, found where the file's strategy makes them wrong, and nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.check import check_paths
from dspark.check.placement_rules import CODES, check_source
from dspark.policy import all_strategies

_HEAD = "import dspark, torch\n"


def _found(body: str) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in check_source(_HEAD + body, "train.py")]


@pytest.mark.parametrize(("body", "found"), [
    ("engine = dspark.Engine(raw_model, optimizer=opt, strategy='zero2')\n"
     "torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)\n", [(3, "DSP009")]),
    ("model = dspark.Engine(model, optimizer=opt, strategy='zero3')\nraw_model = model.module\n"
     "torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)\n", [(4, "DSP009")]),
    ("engine = dspark.Engine(m, optimizer=opt, strategy='zero2')\n"
     "torch.nn.utils.clip_grad_value_(engine.module.parameters(), 1.0)\n", [(3, "DSP009")]),
    ("strategy = 'zero2'\nengine = dspark.Engine(raw_model, optimizer=opt, strategy=strategy)\n"
     "from torch.nn.utils import clip_grad_norm_\nclip_grad_norm_(raw_model.parameters(), 1.0)\n", [(5, "DSP009")]),
    ("engine = dspark.Engine(raw_model, optimizer=opt, strategy=args.strategy)\n"
     "torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)\n", [(3, "DSP011")]),
    ("model = dspark.Engine(model, optimizer=opt, strategy='zero1')\noptimizer = model.optimizer\n"
     "torch.save({'optimizer': optimizer.state_dict()}, 'ckpt.pt')\n", [(4, "DSP010")]),
    ("engine = dspark.Engine(m, optimizer=opt, strategy='zero3')\nengine.optimizer.load_state_dict(sd)\n",
     [(3, "DSP010")]),
    ("engine = dspark.Engine(m, optimizer=opt, strategy='auto')\nsd = engine.optimizer.state_dict()\n",
     [(3, "DSP011")]),
    # the strategy in a config (from a file, say): not read here, so a warning, not silence
    ("engine = dspark.Engine(m, optimizer=opt, config=dspark.EngineConfig(strategy='zero3'))\n"
     "sd = engine.optimizer.state_dict()\n", [(3, "DSP011")]),
    ("engine = dspark.Engine(m, optimizer=opt, **options)\nsd = engine.optimizer.state_dict()\n", [(3, "DSP011")]),
    # nanoGPT's own spelling: model = DDP(model) became the engine, which has no parameters()
    ("model = dspark.Engine(model, optimizer=opt)\n"
     "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n", [(3, "DSP009")]),
])
def test_the_lines_are_found_where_the_strategy_makes_them_wrong(body: str, found: list[tuple[int, str]]) -> None:
    assert _found(body) == found


@pytest.mark.parametrize("strategy", sorted(all_strategies()))
def test_every_strategy_that_shards_gradients_or_state_is_known_to_the_rules(strategy: str) -> None:
    # hybrid-zero1/2/3 shard as their stage does; dspark check passed both lines under them
    body = (f"engine = dspark.Engine(raw_model, optimizer=opt, strategy={strategy!r})\n"
            "torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)\nsd = engine.optimizer.state_dict()\n")
    policy = all_strategies()[strategy]
    assert _found(body) == [(3, "DSP009")] * policy.shard_grads + [(4, "DSP010")] * policy.shard_optimizer


@pytest.mark.parametrize("body", [
    # replicate (the default): both lines are right; zero1: the clip is right
    "engine = dspark.Engine(raw_model, optimizer=opt)\ntorch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)\n",
    "engine = dspark.Engine(raw_model, optimizer=opt, strategy='zero1')\n"
    "torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)\n",
    "model = dspark.Engine(model, optimizer=opt)\noptimizer = model.optimizer\nsd = optimizer.state_dict()\n",
    # not the engine's optimizer or module
    "engine = dspark.Engine(m, optimizer=opt, strategy='zero2')\nplain = torch.optim.SGD(p)\nsd = plain.state_dict()\n",
    "engine = dspark.Engine(m, optimizer=opt, strategy='zero2')\n"
    "torch.nn.utils.clip_grad_norm_(other.parameters(), 1)\n",
    # no engine built here: nothing to read the strategy from
    "optimizer = torch.optim.AdamW(m.parameters())\nsd = optimizer.state_dict()\n",
    "engine.optimizer.state_dict()\n",
])
def test_right_lines_are_not_flagged(body: str) -> None:
    assert _found(body) == []


def test_the_messages_name_the_strategy_and_the_fix() -> None:
    clip, state = (check_source(_HEAD + body, "train.py")[0] for body in (
        "engine = dspark.Engine(raw, optimizer=o, strategy='zero2')\n"
        "torch.nn.utils.clip_grad_norm_(raw.parameters(), 1)\n",
        "engine = dspark.Engine(m, optimizer=o, strategy='zero1')\nsd = engine.optimizer.state_dict()\n"))
    assert "strategy='zero2'" in clip.message and "clips nothing" in clip.message
    assert "clip_grad_norm=c" in clip.message and "engine.clip_grad_norm_(c)" in clip.message
    assert "strategy='zero1'" in state.message and "engine.save(path" in state.message
    assert [CODES[c][0] for c in ("DSP009", "DSP010", "DSP011")] == ["error", "error", "warning"]
    (engine_clip,) = check_source(_HEAD + "model = dspark.Engine(model, optimizer=o)\n"
                                  "torch.nn.utils.clip_grad_norm_(model.parameters(), 1)\n", "train.py")
    assert "model is the dspark.Engine" in engine_clip.message and "engine.clip_grad_norm_(c)" in engine_clip.message


def test_the_examples_have_no_finding() -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    findings, num_files = check_paths([examples])
    assert num_files >= 5 and findings == [], findings
