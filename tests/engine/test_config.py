"""dspark.EngineConfig: each option declared once (type, default, check, doc), keyword options on
top of a config, the docs' tables against the fields (see [Note: options declared once])."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.engine import LossScaler
from dspark.engine.config import GROUPS, EngineConfig
from dspark.engine.config_docs import option_docs, options_table
from tests.engine import tiny_models as tm
from tests.messages import assert_names

ROOT = Path(__file__).resolve().parents[2]
SGD = functools.partial(torch.optim.SGD, lr=0.1)

BAD: dict[str, tuple[Any, type[Exception]]] = {
    "strategy": ("zero4", ValueError),
    "precision": ("fp8", ValueError),
    "grad_accum_steps": (0, ValueError),
    "clip_grad_norm": (-1.0, ValueError),
    "loss_scaler": (2.0**10, TypeError),
    "param_groups": ({"weight_decay": 0.0}, TypeError),
    "memory_budget": (-1, ValueError),
    "bucket_mb": (0, ValueError),
    "reduce_dtype": (torch.int8, ValueError),
    "zero3_units": ("Block", TypeError),
    "broadcast_buffers": (1, TypeError),
    "sync_batchnorm": ("yes", TypeError),
    "shard_group_size": (0, ValueError),
    "skip_nonfinite": ("yes", TypeError),
    "max_nonfinite_skips": (0, ValueError),
    "batch_check_every": (1.5, ValueError),
    "allow_accum_scaled_loss": ("no", TypeError),
    "trace_dir": (3, TypeError),
    "trace_steps": ((1,), ValueError),
}
"""A value each option refuses; a new option without a row here fails the test below."""


def test_every_option_has_a_doc_and_refuses_a_bad_value_naming_it() -> None:
    options = EngineConfig().options()
    assert set(BAD) == set(options), "each option needs a bad value in BAD"
    for name, (bad, kind) in BAD.items():
        assert option_docs()[name][2], f"{name} has no docstring under its field"
        with pytest.raises(kind) as caught:
            EngineConfig().replace(**{name: bad})
        assert_names(str(caught.value), name)
        if not callable(bad) and not isinstance(bad, dict):
            assert_names(str(caught.value), repr(bad))


def test_the_choices_are_listed() -> None:
    with pytest.raises(ValueError) as caught:
        EngineConfig(strategy="zero4")
    assert_names(str(caught.value), "'replicate'", "'zero3'", "'auto'")
    with pytest.raises(ValueError) as caught:
        EngineConfig(precision="fp8")
    assert_names(str(caught.value), "'fp32'", "'bf16'", "'fp16'")


def test_options_that_need_another_are_refused_with_it() -> None:
    with pytest.raises(ValueError) as caught:
        EngineConfig(loss_scaler=LossScaler(), precision="bf16")
    assert_names(str(caught.value), "loss_scaler=", "precision='bf16'", "'fp16'")
    with pytest.raises(ValueError) as caught:
        EngineConfig(strategy="zero2", memory_budget=1000)
    assert_names(str(caught.value), "memory_budget=1000", "strategy='zero2'", "'auto'")
    assert EngineConfig(strategy="auto", memory_budget=1000).memory_budget == 1000


def test_flat_names_reach_their_group_and_the_config_stays_frozen() -> None:
    base = EngineConfig(strategy="zero2")
    changed = base.replace(bucket_mb=50.0, max_nonfinite_skips=None, precision="bf16")
    assert changed.communication.bucket_mb == 50.0 and changed.checks.max_nonfinite_skips is None
    assert changed.precision == "bf16" and changed.strategy == "zero2"
    assert base.communication.bucket_mb == 25.0 and base.checks.max_nonfinite_skips == 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.strategy = "zero3"  # type: ignore[misc]
    with pytest.raises(TypeError) as caught:
        base.replace(bucket_size=10)
    assert_names(str(caught.value), "'bucket_size'", "'bucket_mb'")
    with pytest.raises(TypeError) as caught:
        EngineConfig(communication={"bucket_mb": 1.0})  # type: ignore[arg-type]
    assert_names(str(caught.value), "communication=", "CommunicationConfig")


def test_the_constructor_takes_every_option_by_its_own_name() -> None:
    made = EngineConfig(bucket_mb=50.0, max_nonfinite_skips=None, strategy="zero2", trace_dir=None)
    assert made == EngineConfig(strategy="zero2").replace(bucket_mb=50.0, max_nonfinite_skips=None)
    assert made.communication.bucket_mb == 50.0 and made.checks.max_nonfinite_skips is None
    with pytest.raises(TypeError) as caught:
        EngineConfig(bucket_size=10)
    assert_names(str(caught.value), "'bucket_size'", "'bucket_mb'")
    with pytest.raises(ValueError) as caught_value:
        EngineConfig(bucket_mb=-1)
    assert_names(str(caught_value.value), "bucket_mb=-1")


def test_a_dict_round_trip_as_a_file_holds_it() -> None:
    config = EngineConfig(strategy="zero3", precision="fp16", loss_scaler=LossScaler(scale=1024.0)).replace(
        reduce_dtype=torch.bfloat16, trace_steps=(0, 3), batch_check_every=None)
    plain = config.to_dict()
    assert plain["communication"]["reduce_dtype"] == "torch.bfloat16"
    assert plain["observation"]["trace_steps"] == [0, 3]
    assert EngineConfig.from_dict({**plain, "loss_scaler": None}) == dataclasses.replace(config, loss_scaler=None)
    assert EngineConfig.from_dict({"bucket_mb": 5, "checks": {"skip_nonfinite": False}}).options() == {
        **EngineConfig().options(), "bucket_mb": 5, "skip_nonfinite": False}
    with pytest.raises(ValueError) as caught:
        EngineConfig.from_dict({"checks": {"bucket_mb": 5}})
    assert_names(str(caught.value), "checks.bucket_mb", "skip_nonfinite")
    with pytest.raises(ValueError) as caught:
        EngineConfig.from_dict({"reduce_dtype": "bfloat17"})
    assert_names(str(caught.value), "'bfloat17'")


def test_ranks_agree_on_every_option_but_where_output_goes_and_the_budget() -> None:
    settings = EngineConfig(param_groups=lambda name, p: {}).agreed_settings()
    assert set(EngineConfig().options()) - set(settings) == {"trace_dir", "trace_steps", "memory_budget"}
    assert settings["param_groups"] == "<test_ranks_agree_on_every_option_but_where_output_goes_and_the_budget" \
                                       ".<locals>.<lambda>>"


def test_keyword_options_override_the_config(single_process) -> None:
    base = EngineConfig(strategy="zero2").replace(bucket_mb=1.0, max_nonfinite_skips=3)
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, config=base, bucket_mb=2.0)
    assert engine.strategy.name == "zero2" and engine.config.checks.max_nonfinite_skips == 3
    assert engine.config.communication.bucket_mb == 2.0 and base.communication.bucket_mb == 1.0
    engine.close()
    with pytest.raises(TypeError) as caught:
        dspark.Engine(tm.make("mlp"), optimizer=SGD, config={"strategy": "zero2"})  # type: ignore[arg-type]
    assert_names(str(caught.value), "config", "dict")
    with pytest.raises(TypeError) as caught:
        dspark.Engine(tm.make("mlp"), optimizer=SGD, max_nonfinite_skip=3)
    assert_names(str(caught.value), "'max_nonfinite_skip'", "'max_nonfinite_skips'")


def test_one_config_builds_engines_that_do_not_share_a_loss_scaler(single_process) -> None:
    config = EngineConfig(precision="fp16", loss_scaler=LossScaler(scale=1024.0))
    first = dspark.Engine(tm.make("mlp"), optimizer=SGD, config=config)
    second = dspark.Engine(tm.make("mlp"), optimizer=SGD, config=config)
    assert first.loss_scaler is not second.loss_scaler and first.loss_scaler is not config.loss_scaler
    assert first.loss_scale == second.loss_scale == 1024.0
    first.close()
    second.close()


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start) + len(start):text.index(end, text.index(start))].strip()


def test_the_engine_page_shows_the_generated_table() -> None:
    page = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    shown = _between(page, "<!-- options: generated by dspark.engine.config_docs.options_table() -->",
                     "<!-- end of options -->")
    assert shown == options_table(), (
        "docs/engine.md's options table differs from EngineConfig's fields; paste the output of\n"
        ".venv/bin/python -c 'from dspark.engine.config_docs import options_table; print(options_table())'")


def test_the_readme_table_names_every_option_and_nothing_else() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| `dspark.Engine(model, *, ...)` |"):]
    lines = table.splitlines()
    rows = lines[2:lines.index("", 2)] if "" in lines[2:] else lines[2:]
    named = {name for line in rows for name in re.findall(r"`(\w+)`", line.split("|")[1])}
    inputs = {"optimizer", "config", "sample_batch", "loss_fn"}
    assert not (missing := set(EngineConfig().options()) - named), f"README's table lacks {missing}"
    assert not (unknown := named - set(EngineConfig().options()) - inputs), \
        f"README's table names {unknown}, which are not options of dspark.EngineConfig"


def test_groups_hold_what_their_names_say() -> None:
    assert {name: group.__name__ for name, group in GROUPS.items()} == {
        "communication": "CommunicationConfig", "checks": "ChecksConfig", "observation": "ObservationConfig"}


def test_engine_signature_names_every_option_with_its_default() -> None:
    import inspect

    parameters = inspect.signature(dspark.Engine).parameters
    for name, value in EngineConfig().options().items():
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and parameters[name].default == value, name
    assert list(parameters)[:2] == ["model", "optimizer"]


def test_a_single_class_as_zero3_units_is_refused_naming_the_list() -> None:
    with pytest.raises(TypeError) as caught:
        EngineConfig().replace(zero3_units=torch.nn.Linear)  # a class is callable: it was taken as a predicate
    assert_names(str(caught.value), "zero3_units=", "Linear", "[Linear]")
    assert EngineConfig().replace(zero3_units=[torch.nn.Linear]).communication.zero3_units == [torch.nn.Linear]


def test_a_loss_scaler_round_trips_and_from_dict_takes_only_a_mapping() -> None:
    config = EngineConfig(precision="fp16", loss_scaler=LossScaler(scale=1024.0, growth_interval=10))
    assert EngineConfig.from_dict(config.to_dict()) == config
    with pytest.raises(TypeError) as caught:
        EngineConfig.from_dict([("strategy", "zero2")])  # type: ignore[arg-type]
    assert_names(str(caught.value), "from_dict", "list")
