"""Materialising a model built on the meta device (``with torch.device("meta"): model = Model()``).

[Note: meta initialisation] Building a model on the CPU runs each module's ``reset_parameters()`` as the
module is constructed: children before the parent that holds them. DSpark replays exactly that: it
walks the modules children-first (post-order, siblings in registration order), gives each module real
(empty) storage for its own parameters and buffers and calls its ``reset_parameters()``. With the same
seed the random stream is consumed in the same order, so the values equal the CPU-built model's, as
long as registration order is construction order: a module constructed before a sibling but assigned
to its parent after it (``head = nn.Linear(..); self.body = ..; self.head = head``) drew its numbers
first on the CPU and draws them second here, and nothing left in the module tree says so. Two
details keep that true:

* a parameter shared by two modules (a tied head) takes the initialisation of the first module that
  holds it, as construction does when the later module's own tensor is replaced by the shared one
  (``lm_head.weight = wte.weight``); a tie the other way round (``wte.weight = lm_head.weight``,
  nanoGPT's) leaves no trace in the module tree, so when no ancestor's ``reset_parameters()``
  initialises the tied tensor after both, a warning names it and the fix;
  the later module's ``reset_parameters()`` still runs, on a throwaway tensor, so the stream advances
  as it did on the CPU;
* a parameter is final once every ancestor that defines ``reset_parameters()`` has run (a parent may
  re-initialise its children, as nanoGPT-style ``_init_weights`` does); the caller hears of each
  parameter at that moment, so zero3 can keep its rows and free the rest before the next module is
  materialised: no rank ever holds more than a few modules' parameters in full.

Every tensor starts as NaN (or the most negative integer); one still holding it after initialisation
was initialised by nobody, and is an error that names it.

Initialisation done outside ``reset_parameters()`` (``self.apply(fn)`` in ``__init__``, a loop over
``named_parameters()``, HuggingFace's ``post_init()``) leaves no trace in the module tree, so under a
plain ``torch.device("meta")`` this walk would give those parameters PyTorch's defaults instead (a
nanoGPT embedding with std 1.0 instead of 0.02). Before anything is materialised, the constructors of
the model's own module classes are read (:mod:`dspark.meta.init_scan`); one that initialises
parameters itself is refused with the fix, ``dspark.meta_init()``. A model built under
``dspark.meta_init()`` is materialised by replaying what its code did instead ([Note: recorded
initialisation] in :mod:`dspark.meta.record`), one parameter at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from dspark.meta.init_scan import check_reset_only
from dspark.meta.record import forget, record_of, replay

log = logging.getLogger(__name__)

__all__ = ["has_meta_tensors", "materialize"]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device.

    Example::

        with torch.device("meta"):
            has_meta_tensors(nn.Linear(2, 2))   # True
    """
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _poisoned(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).all())


def _post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", root)
    return out


def materialize(root: nn.Module, device: torch.device,
                on_final: Callable[[str, nn.Parameter], None]) -> None:
    """Give every meta parameter and buffer of ``root`` real storage on ``device`` and initialise it
    with the modules' ``reset_parameters()`` (see [Note: meta initialisation]). Parameters and buffers
    keep their identity (their storage is swapped in), so ties and references stay valid.
    ``on_final(name, param)`` is called once per parameter, as soon as nothing will change it any more,
    with its first name.

    Example::

        with torch.device("meta"):
            model = Model()
        materialize(model, torch.device("cpu"), lambda name, p: None)
    """
    if not hasattr(torch.utils, "swap_tensors"):
        raise RuntimeError(f"materialising a meta-device model needs torch.utils.swap_tensors (PyTorch "
                           f">= 2.3); this is PyTorch {torch.__version__}")
    if any(record_of(t) is not None for t in (*root.parameters(), *root.buffers())):
        _materialize_recorded(root, device, on_final)
        return
    check_reset_only(root)
    order = _post_order(root)
    first_name: dict[int, str] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    for name, b in root.named_buffers(remove_duplicate=False):
        first_name.setdefault(id(b), name)
    # ancestors with reset_parameters: a parameter is final after the last of them (in post-order) ran
    position = {id(m): i for i, (_, m) in enumerate(order)}
    final_after: dict[int, int] = {}
    for name, module in order:
        ancestors = _ancestors(root, name)
        resetting = [position[id(a)] for a in ancestors if _initialiser(a) is not None]
        for p in module.parameters(recurse=False):
            after = max([position[id(module)], *resetting])
            final_after[id(p)] = max(final_after.get(id(p), after), after)
    done: set[int] = set()  # tensors given real storage (the same Python objects: ties stay tied)
    holder: dict[int, str] = {}  # the name under which each was first given storage
    pending: dict[int, list[nn.Parameter]] = {}
    for index, (_name, module) in enumerate(order):
        shared: dict[tuple[str, str], torch.Tensor] = {}
        for kind in ("_parameters", "_buffers"):
            table = getattr(module, kind)
            for key, t in list(table.items()):
                if t is None or (not t.is_meta and id(t) not in done):
                    continue
                if id(t) in done:  # shared with a module initialised earlier: it keeps that value
                    if kind == "_parameters" and _initialiser(module) is not None and final_after[id(t)] == index:
                        _warn_tie_direction(holder[id(t)], f"{_name}.{key}".lstrip("."))
                    shared[(kind, key)] = t
                    table[key] = _real_like(t, device, kind)  # what this module initialises, then drops
                    continue
                torch.utils.swap_tensors(t, _real_like(t, device, kind))
                _poison(t.data)
                done.add(id(t))
                holder[id(t)] = f"{_name}.{key}".lstrip(".")
                if kind == "_parameters":
                    pending.setdefault(final_after[id(t)], []).append(t)  # type: ignore[arg-type]
        reset = _initialiser(module)
        if reset is not None:
            with torch.no_grad():
                reset()
        for (kind, key), t in shared.items():
            getattr(module, kind)[key] = t
        for p in pending.pop(index, []):
            _check_initialised(first_name.get(id(p), "?"), p, module)
            on_final(first_name.get(id(p), "?"), p)
    for name, b in root.named_buffers():
        if _poisoned(b):
            raise ValueError(f"buffer {name!r} (shape {tuple(b.shape)}) was created on the meta device "
                             "and no reset_parameters() initialised it; give its module a "
                             "reset_parameters() that sets it, or build the model on a real device")


def _materialize_recorded(root: nn.Module, device: torch.device,
                          on_final: Callable[[str, nn.Parameter], None]) -> None:
    """A model built under ``dspark.meta_init()``: each parameter's recorded initialisation replayed on
    the CPU, moved to ``device`` and handed to ``on_final`` before the next one is made."""
    meta = [(n, t) for n, t in (*root.named_parameters(), *root.named_buffers()) if t.is_meta]
    unrecorded = [n for n, t in meta if record_of(t) is None]
    if unrecorded:
        raise ValueError(f"{len(unrecorded)} tensor(s) of the model are on the meta device but were not "
                         f"built under dspark.meta_init() ({unrecorded[:5]}): build the whole model "
                         "inside one `with dspark.meta_init():`")
    problems = [f"{n}: {record.problem}" for n, t in meta
                if (record := record_of(t)) is not None and record.problem is not None]
    if problems:
        raise ValueError(f"DSpark cannot reproduce the initialisation of {len(problems)} parameter(s) "
                         f"built under dspark.meta_init(): {'; '.join(problems[:5])}. Nothing was "
                         "trained. Initialise them with in-place operations on the parameter itself "
                         "(torch.nn.init.*, fill_, mul_, ...), or build the model on the CPU")
    for module in root.modules():
        for key, b in list(module._buffers.items()):
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[key] = b.to(device)
    with torch.no_grad():
        for name, t in meta:
            record = record_of(t)
            assert record is not None
            value = replay(record, name).to(device=device, dtype=t.dtype)
            forget(t)
            if isinstance(t, nn.Parameter):
                torch.utils.swap_tensors(t, nn.Parameter(value, requires_grad=t.requires_grad))
                on_final(name, t)
            else:
                torch.utils.swap_tensors(t, value)


def _warn_tie_direction(kept: str, other: str) -> None:
    module = kept.rpartition(".")[0] or "the root"
    log.warning(
        "meta initialisation: %s is the same parameter as %s and takes the initialisation of %s, the "
        "first module that holds it: what the CPU build gives when the model ties %s = %s (as Hugging "
        "Face models do). A model that ties the other way round (%s = %s, nanoGPT's) got the other "
        "module's on the CPU: initialise tied weights in a parent's reset_parameters() (which runs "
        "after both), or build the model on the CPU", kept, other, module, other, kept, kept, other)


def _initialiser(module: nn.Module) -> Callable[[], object] | None:
    """``module.reset_parameters``, or for PyTorch's own modules that name it privately
    (``nn.MultiheadAttention._reset_parameters``, which its constructor calls) that one."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset  # type: ignore[no-any-return]
    private = getattr(module, "_reset_parameters", None)
    if callable(private) and type(module).__module__.startswith("torch.nn."):
        return private  # type: ignore[no-any-return]
    return None


def _check_initialised(name: str, p: torch.Tensor, module: nn.Module) -> None:
    if _poisoned(p):
        raise ValueError(f"parameter {name!r} (shape {tuple(p.shape)}) was built on the meta device and "
                         f"no reset_parameters() initialised it ({type(module).__name__} and its parents "
                         "define none that sets it). Give the module that creates it a "
                         "reset_parameters(), or build the model on a real device")


def _real_like(t: torch.Tensor, device: torch.device, kind: str) -> torch.Tensor:
    real = torch.empty_like(t, device=device)
    if kind == "_parameters":
        return nn.Parameter(real, requires_grad=t.requires_grad)
    return real


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules above ``name`` (the root first), ``name`` excluded."""
    if not name:
        return []
    parts = name.split(".")
    out = [root]
    module = root
    for part in parts[:-1]:
        module = getattr(module, part)
        out.append(module)
    return out
