"""peft models (LoRA and peft's other tuners) in and out of the engine: which of their tensors are the
base model's weights and under which names the base model knows them, the adapter as peft saves
it, and the merged model.

[Note: peft names] peft wraps a model without copying it: ``get_peft_model(model, LoraConfig(...))``
puts it under ``base_model.model.``, moves each adapted layer's own module under ``.base_layer.``
and adds the adapter's tensors beside it (``q_proj.lora_A.default.weight``); a module listed in
``modules_to_save`` becomes ``.original_module.`` plus a trainable copy per adapter
(``.modules_to_save.default.``). :func:`adapter_layout` walks the module tree along each state-dict
name and gives every tensor its name in the base model (``model.layers.0.self_attn.q_proj.weight``)
or marks it as the adapter's own. That is all a base checkpoint needs to fill a peft model (the
adapter's tensors keep the values their own initialisation gave them), and what the merged model's
files are named. Nothing here guesses from strings: the walk goes by peft's own classes, so a name
that merely contains ``base_layer`` is left alone.

The adapter's own files are written by peft (``PeftModel.save_pretrained`` on rank 0, given the
gathered tensors), so their layout is peft's by construction. The merged weights come from peft's
own ``merge()`` of each layer, run on copies of the base layer's tensors (the model is left as it
was, bitwise).

peft is imported only when a model holds peft's modules: it is not a dependency of DSpark.

Example::

    layout = adapter_layout(peft_model, peft_model.state_dict().keys())
    layout.base_name["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    # 'model.layers.0.self_attn.q_proj.weight'
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.engine.weights import SavedTensor, WeightEntry

__all__ = ["AdapterLayout", "adapter_layout", "adapter_tensor_names", "base_load_problem", "holds_peft",
           "merged_tensors", "save_adapter"]

_INITS_WITHOUT_BASE = (True, False, "gaussian")
"""LoRA initialisations that do not read the base weights (peft's ``init_lora_weights``)."""


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """Where each tensor of a model holding peft modules comes from (see [Note: peft names])."""

    base_name: dict[str, str]
    """State-dict name -> the base model's name, for every base weight (every ``modules_to_save``
    copy too: it starts as the base module's value)."""
    adapter: frozenset[str]
    """State-dict names of the adapters' own tensors (``lora_A``, ``lora_B``, ...), which a base
    model does not have."""
    copies: dict[str, str]
    """State-dict name of an active adapter's ``modules_to_save`` copy -> its base name (the merged
    model takes the copy's value there)."""
    tuner_layers: dict[str, Any]
    """Path -> each layer peft adapted (LoRA's ``Linear``...), which merges itself."""
    is_peft_model: bool
    """The root is a ``peft.PeftModel`` (its adapter can be saved as peft saves it)."""

    def sources(self, tied: Iterable[Sequence[str]] = ()) -> dict[str, list[str]]:
        """Base name -> the state-dict names it fills (a base module and its ``modules_to_save``
        copies). ``tied``: the names of each tied tensor; the base model ties their base names too,
        and its files hold one of them (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``),
        which then fills all of them.

        Example::

            layout.sources()["lm_head.weight"]   # [".. lm_head.original_module.weight", "..
            modules_to_save.default.weight"]
        """
        out: dict[str, list[str]] = {}
        for name, base in self.base_name.items():
            out.setdefault(base, []).append(name)
        for names in tied:
            bases = list(dict.fromkeys(self.base_name[n] for n in names if n in self.base_name))
            filled = list(dict.fromkeys(n for base in bases for n in out[base]))
            for base in bases:
                out[base] = filled
        return out


def holds_peft(module: nn.Module) -> bool:
    """Whether ``module`` holds any of peft's modules (its state-dict names are then peft's).

    Example::

        holds_peft(get_peft_model(model, LoraConfig(target_modules=["q_proj"])))   # True
    """
    return any(type(m).__module__.startswith("peft.") for m in module.modules())


def adapter_layout(module: nn.Module, names: Iterable[str]) -> AdapterLayout | None:
    """The layout of ``module``'s state-dict ``names`` when it holds peft modules, else None. A prompt
    learning model (prefix or prompt tuning) is refused: its adapter is not tensors beside the base
    weights, and DSpark does not save or load it.

    Example::

        adapter_layout(peft_model, peft_model.state_dict())    # AdapterLayout(base_name={...}, ...)
        adapter_layout(plain_model, plain_model.state_dict())  # None
    """
    if not holds_peft(module):
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(module, PeftModel) and module.active_peft_config.is_prompt_learning:
        raise ValueError(f"{type(module.active_peft_config).__name__} is prompt learning, whose adapter "
                         "DSpark does not save or load; peft's tuners that add tensors beside the base "
                         "weights (LoRA, IA3, ...) are supported")
    base_name: dict[str, str] = {}
    adapter: set[str] = set()
    copies: dict[str, str] = {}
    for name in names:
        parts = name.split(".")
        kept: list[str] = []
        current = module
        kind = "base"
        i = 0
        while i < len(parts) - 1 and kind != "adapter":
            part = parts[i]
            child = current._modules.get(part)
            if child is None:
                break
            if isinstance(current, (PeftModel, BaseTuner)):
                wrapped = "base_model" if isinstance(current, PeftModel) else "model"
                kind = kind if part == wrapped else "adapter"
            elif isinstance(current, BaseTunerLayer):
                kind = kind if part == "base_layer" else "adapter"
            elif isinstance(current, AuxiliaryTrainingWrapper):
                if isinstance(current, ModulesToSaveWrapper) and part == "modules_to_save" and i + 2 < len(parts):
                    active = parts[i + 1] in current.active_adapters
                    kind = "copy" if active else "inactive copy"
                    child = current.modules_to_save[parts[i + 1]]
                    i += 1
                elif part != "original_module":
                    kind = "adapter"
            else:
                kept.append(part)
            current = child
            i += 1
        if kind == "adapter":
            adapter.add(name)
            continue
        base = ".".join([*kept, *parts[i:]])
        base_name[name] = base
        if kind == "copy":
            copies[name] = base
    tuner_layers = {path: m for path, m in module.named_modules() if isinstance(m, BaseTunerLayer)}
    return AdapterLayout(base_name, frozenset(adapter), copies, tuner_layers, isinstance(module, PeftModel))


def base_load_problem(module: nn.Module) -> str | None:
    """Why base weights cannot be loaded into the peft model ``module`` after its adapter was made,
    or None: an adapter initialised from the base weights it saw then (DoRA's magnitudes, PiSSA,
    OLoRA, LoftQ, EVA...) would not belong with the base weights loaded afterwards.

    Example::

        base_load_problem(get_peft_model(model, LoraConfig(use_dora=True)))   # "adapter 'default' ..."
    """
    for name, config in (getattr(module, "peft_config", None) or {}).items():
        init = getattr(config, "init_lora_weights", True)
        dora = bool(getattr(config, "use_dora", False))
        if dora or not any(type(init) is type(ok) and init == ok for ok in _INITS_WITHOUT_BASE):
            return (f"adapter {name!r} was initialised from the base weights it saw when peft made it "
                    f"(use_dora={dora!r}, init_lora_weights={init!r}), so base weights loaded "
                    "afterwards would not match it. Load the base model's weights before get_peft_model "
                    "(from_pretrained on the CPU), or use init_lora_weights=True, False or 'gaussian' "
                    "without DoRA")
    return None


def adapter_tensor_names(module: nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """The state-dict names peft's ``save_pretrained`` writes for every adapter of the ``PeftModel``
    ``module`` (``shapes``: every state-dict name -> shape and dtype). Found by handing peft a state
    dict of meta tensors; a value peft computes rather than picks is refused, since the engine
    could only hand it freed parameters under zero3.

    Example::

        adapter_tensor_names(peft_model, {n: (tuple(t.shape), t.dtype) for n, t in sd.items()})
    """
    from peft.utils import get_peft_model_state_dict

    probe = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    name_of = {id(t): name for name, t in probe.items()}
    needed: dict[str, None] = {}
    configs: Any = getattr(module, "peft_config", {})
    for adapter in configs:
        picked = get_peft_model_state_dict(module, state_dict=probe, adapter_name=adapter)
        for key, value in picked.items():
            if id(value) not in name_of:
                raise ValueError(f"peft computes {key!r} of adapter {adapter!r} rather than taking a "
                                 "tensor of the model; DSpark cannot save it faithfully (save with "
                                 "merged=True, or gather the model with engine.full_state_dict())")
            needed[name_of[id(value)]] = None
    return list(needed)


def save_adapter(module: nn.Module, directory: Path, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Rank 0: peft writes ``module``'s adapters into ``directory`` from ``state_dict`` (the tensors
    :func:`adapter_tensor_names` named, whole): ``adapter_model.safetensors`` and
    ``adapter_config.json``, as ``PeftModel.save_pretrained`` does.

    Example::

        save_adapter(peft_model, "out/lora", {n: t for n, t in gathered.items()})
    """
    save: Any = module.save_pretrained
    save(str(directory), state_dict=dict(state_dict))


def merged_tensors(layout: AdapterLayout, entries: Sequence[WeightEntry]) -> list[SavedTensor]:
    """The merged model's tensors, under the base model's names: each adapted layer's base weights
    with its active adapters merged in, each ``modules_to_save`` module as its active copy, every
    other base weight as it is; the adapters' own tensors are left out.

    Example::

        names = [t.name for t in merged_tensors(layout, entries)]   # the base model's state-dict names
    """
    by_name = {name: entry for entry in entries for name in entry.names}
    taken_from_copy = set(layout.copies.values())
    for entry in entries:
        bases = {layout.base_name[n] for n in entry.names if n in layout.base_name}
        if len(bases) > 1 and bases & taken_from_copy:
            raise ValueError(f"the base model ties {sorted(bases)}, but the adapter trains a copy of "
                             f"{sorted(bases & taken_from_copy)} only (modules_to_save), so the merged model "
                             "cannot hold both under one tied weight: save the adapter (merged=False)")
    rewritten: dict[str, tuple[Any, str, tuple[WeightEntry, ...]]] = {}
    for path, layer in layout.tuner_layers.items():
        if getattr(layer, "merged", False):
            raise ValueError(f"{path} already holds merged adapters {list(layer.merged_adapters)}: call "
                             "unmerge_adapter() before saving")
        own = tuple(dict.fromkeys(e for n, e in by_name.items() if n.startswith(path + ".")))
        prefix, current = path, layer
        while hasattr(current, "base_layer"):
            prefix, current = prefix + ".base_layer", current.base_layer
        for param_name, param in current._parameters.items():
            if param is not None:
                rewritten[f"{prefix}.{param_name}"] = (layer, param_name, own)
    out: list[SavedTensor] = []
    for entry in entries:
        name = next((n for n in entry.names if n in layout.base_name), None)
        if name is None:
            continue  # the adapter's own tensor
        base = layout.base_name[name]
        if base in taken_from_copy and name not in layout.copies:
            continue  # the original of a module the active adapter trained a copy of
        if name in rewritten:
            layer, param_name, needs = rewritten[name]
            value = functools.partial(_merged, layer, param_name)
            out.append(SavedTensor(base, entry.shape, entry.dtype, (entry, *needs), value))
        else:
            out.append(SavedTensor(base, entry.shape, entry.dtype, (entry,), entry.full))
    return out


def _merged(layer: Any, param_name: str) -> torch.Tensor:
    """The tuner ``layer``'s base tensor ``param_name`` with the active adapters merged by peft's own
    ``merge()``, computed on copies of the base layer's parameters: the layer is left as it was."""
    base: nn.Module = layer.get_base_layer()
    originals = dict(base._parameters)
    merged_before = list(layer.merged_adapters)
    try:
        for name, param in originals.items():
            if param is not None:
                base._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=False)
        with torch.no_grad():
            layer.merge(adapter_names=list(layer.active_adapters))
        merged = base._parameters[param_name]
        if merged is None:
            raise AssertionError(f"peft's merge removed {param_name!r} from {type(base).__name__}")
        return merged.detach()
    finally:
        base._parameters.update(originals)
        layer.merged_adapters[:] = merged_before
