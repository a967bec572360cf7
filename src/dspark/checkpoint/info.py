"""``dspark.json``: a small, human-readable description of a checkpoint next to DCP's files (what
wrote it, at which step, on how many ranks, with which versions). Loading does not depend on it for
the data, only to recognise a DSpark checkpoint; DCP's ``.metadata`` is the authority on tensors.

Format 3 (this one) adds ``manifest.json``, against which every file is checked before it is used
(see [Note: checkpoint integrity] in :mod:`dspark.checkpoint.manifest`); ``dspark.json`` is read only
once it matches. Format 2 kept every non-tensor value in JSON but had no manifest. A checkpoint
without a manifest (format 2, or one whose manifest was removed) loads only when the caller says so
(``engine.load(path, verify=False)``, ``dspark ckpt info|export --no-verify``), never because its own
files say they are of an older format: a file anyone can edit cannot switch the check off. Format 1
stored some values as pickles inside DCP's files and is refused, since loading it could run code."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspark.checkpoint.manifest import MANIFEST_FILE, SUMMARY_FIELDS, read_manifest, read_verified
from dspark.checkpoint.plain_files import DSPARK_JSON, write_json
from dspark.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "INFO_FILE", "CheckpointInfo", "check_is_checkpoint",
           "check_outside_checkpoint", "is_checkpoint", "read_checkpoint_info", "write_info"]

log = logging.getLogger(__name__)

INFO_FILE = "dspark.json"
FORMAT_NAME = "dspark-checkpoint"
FORMAT_VERSION = 3
_UNVERIFIED_VERSION = 2
"""Written before manifests: loaded only with ``verify=False``, with a warning that nothing was checked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """What ``dspark.json`` says about a checkpoint."""

    step_count: int
    """Optimizer steps the engine had taken when it saved."""
    strategy: str
    """The strategy that wrote it ("replicate", "zero1", ...); any strategy can load it."""
    precision: str
    """The engine's precision ("fp32", "bf16", "fp16")."""
    world_size: int
    """Ranks that wrote it; any world size can load it."""
    optimizer: str
    """The optimizer's class name, e.g. "AdamW"."""
    num_param_groups: int
    """Parameter groups of the optimizer (the loading optimizer must have as many)."""
    num_params: int
    """Elements of all trainable parameters (tied ones once)."""
    params: dict[str, list[int]] = field(default_factory=dict)
    """Trainable parameter name -> global shape as saved (0-d parameters as [1])."""
    scalar_params: list[str] = field(default_factory=list)
    """Parameters that are 0-d in the model (saved as shape [1], the only way to split them by rows)."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """A tied parameter's saved name -> its other names in ``model.state_dict()`` (nanoGPT's
    ``lm_head.weight`` beside ``transformer.wte.weight``); empty in checkpoints written before."""
    dspark_version: str = ""
    torch_version: str = ""
    created_utc: str = ""
    """ISO-8601 time of the save."""
    save_id: str = ""
    """The save's id, which every file of the checkpoint carries or is listed under in its manifest
    ("" in a format-2 checkpoint)."""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version == 1:
            raise CheckpointError("checkpoint format_version=1 was written by an older DSpark that kept "
                                  "some values as pickles, which this DSpark refuses to load (loading "
                                  f"a pickle can run code); valid: {FORMAT_VERSION}. Re-save it with "
                                  "the DSpark that wrote it, or start from its weights")
        if self.format_version not in (FORMAT_VERSION, _UNVERIFIED_VERSION):
            raise CheckpointError(f"checkpoint format_version={self.format_version!r} is not supported "
                                  f"by this DSpark (valid: {_UNVERIFIED_VERSION}, {FORMAT_VERSION})")
        counts = {"step_count": 0, "world_size": 1, "num_param_groups": 1, "num_params": 0}
        for name, least in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CheckpointError(f"{name}={value!r} must be an int >= {least}")
        for name in ("strategy", "precision", "optimizer", "dspark_version", "torch_version", "created_utc",
                     "save_id"):
            if not isinstance(getattr(self, name), str):
                raise CheckpointError(f"{name}={getattr(self, name)!r} must be a string")
        if not isinstance(self.params, dict) or not all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(n, int) and not isinstance(n, bool)
                                                                    and n >= 0 for n in v)
                for k, v in self.params.items()):
            raise CheckpointError(f"params={self.params!r:.120} must map names to lists of sizes")
        if not isinstance(self.scalar_params, list) or not all(isinstance(n, str) for n in self.scalar_params):
            raise CheckpointError(f"scalar_params={self.scalar_params!r:.120} must be a list of names")
        if not isinstance(self.aliases, dict) or not all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(n, str) for n in v)
                for k, v in self.aliases.items()):
            raise CheckpointError(f"aliases={self.aliases!r:.120} must map names to lists of names")


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a DSpark checkpoint (its ``dspark.json``).

    Example::

        if dspark.checkpoint.is_checkpoint("ckpt"):
            engine.load("ckpt")
    """
    return (Path(path) / INFO_FILE).is_file()


def check_outside_checkpoint(path: str | os.PathLike[str], *, what: str, may_be_one: bool = False) -> None:
    """Raise ``ValueError`` when ``path`` (where ``what`` is about to write) is a DSpark checkpoint
    directory (unless ``may_be_one``: engine.save replaces one) or lies inside one (see [Note:
    nothing is written inside a checkpoint]).

    Example::

        check_outside_checkpoint("ckpt/latest/hf", what="save_pretrained")
        # ValueError: save_pretrained into '.../ckpt/latest/hf': it is inside the checkpoint ...
    """
    here = Path(path).absolute()
    candidates = here.parents if may_be_one else (here, *here.parents)
    holder = next((d for d in candidates if is_checkpoint(d)), None)
    if holder is None:
        return
    where = "is the checkpoint" if holder == here else f"is inside the checkpoint {str(holder)!r}"
    beside = holder.parent / f"{holder.name}-{'export' if holder == here else here.name}"
    raise ValueError(f"{what} into {str(here)!r}: it {where}, whose files a load checks and whose "
                     "directory the next engine.save there replaces whole (what was written inside "
                     f"is lost): write it beside the checkpoint instead, e.g. "
                     f"{str(beside)!r}")


# [Note: nothing is written inside a checkpoint] A checkpoint directory belongs to engine.save: a
# save publishes a new directory in its place (see [Note: atomic save]), so an export, a
# save_pretrained or another checkpoint written into it or below it is deleted by the next save, and
# files of the same names (config.json) would change what a load reads and checks. Each writer
# refuses such a path before it writes anything; the reverse, engine.save onto an export's
# directory, is refused because it is not a checkpoint (engine.save replaces only a checkpoint or
# an empty directory).


def write_info(directory: Path, info: CheckpointInfo) -> None:
    """Write ``info`` as ``directory/dspark.json`` (rank 0 only; the directory is not yet published).

    Example::

        write_info(Path("/tmp/ck.tmp"), CheckpointInfo(step_count=3, strategy="zero2", ...))
    """
    write_json(directory / INFO_FILE, {"format": FORMAT_NAME, **asdict(info)})


def read_checkpoint_info(path: str | os.PathLike[str], *, verify: bool = True) -> CheckpointInfo:
    """The description of the checkpoint at ``path``.

    Raises :class:`CheckpointNotFoundError` when there is no DSpark checkpoint there,
    :class:`CheckpointError` when ``dspark.json`` is damaged, and :class:`CheckpointIntegrityError`
    when the checkpoint has no ``manifest.json`` unless ``verify=False`` (then it is read unchecked,
    with a warning; a manifest that is there is checked either way).

    Example::

        info = dspark.checkpoint.read_checkpoint_info("ckpt")
        info.step_count, info.strategy, info.world_size    # (200, 'zero3', 2)
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(verify, bool):  # None or 0 from a caller's own option must not mean "unchecked"
        raise TypeError(f"verify={verify!r} must be True or False, got {type(verify).__name__}: only "
                        f"verify=False reads a checkpoint without {MANIFEST_FILE}, unchecked")
    directory = Path(path)
    check_is_checkpoint(directory)
    info_path = directory / INFO_FILE
    manifest = read_manifest(directory)
    try:
        raw: Any = json.loads(read_verified(directory, INFO_FILE, manifest, DSPARK_JSON).decode("utf-8"))
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{str(info_path)!r} is damaged ({type(exc).__name__}: {exc})") from exc
    if not isinstance(raw, dict) or raw.pop("format", None) != FORMAT_NAME:
        raise CheckpointError(f"{str(info_path)!r} is not a DSpark checkpoint description "
                              f"(no \"format\": {FORMAT_NAME!r})")
    try:
        info = CheckpointInfo(**raw)
    except TypeError as exc:
        raise CheckpointError(f"{str(info_path)!r} has unexpected fields ({exc})") from exc
    except CheckpointError as exc:
        raise CheckpointError(f"{str(info_path)!r}: {exc}") from exc
    if manifest is None:
        if verify:
            raise CheckpointIntegrityError(
                f"{str(directory)!r} has no {MANIFEST_FILE}, so none of its files can be checked (its "
                f"{INFO_FILE} says format {info.format_version!r}; a format-3 checkpoint always has one: "
                "it was removed, or the checkpoint copied in part). To load it unchecked all the same, "
                "say so: engine.load(path, verify=False), or --no-verify on the command line")
        log.warning("checkpoint %s has no %s and is read with verify=False: its files are NOT "
                    "verified; a foreign or damaged file would load silently. Save it again to get a "
                    "manifest", directory, MANIFEST_FILE)
        return info
    differ = [k for k in SUMMARY_FIELDS if manifest.summary.get(k) != getattr(info, k)]
    if info.save_id != manifest.save_id or differ:
        raise CheckpointIntegrityError(f"{str(directory / MANIFEST_FILE)!r} and {INFO_FILE} disagree "
                                       f"(in {differ or ['save_id']}): the manifest was edited")
    return info


def check_is_checkpoint(directory: Path) -> None:
    """:class:`CheckpointNotFoundError`, saying what is there instead, unless ``directory`` is a
    DSpark checkpoint directory (it holds ``dspark.json``).

    Example::

        check_is_checkpoint(Path("ckpt"))
    """
    if not directory.exists():
        stranded = sorted(p.name for p in directory.parent.glob(f".{directory.name}.old-*"))
        hint = (f"; a previous checkpoint was left at {stranded[0]!r} by a save interrupted while "
                "it was being replaced: rename it to restore it") if stranded else ""
        raise CheckpointNotFoundError(f"no checkpoint at {str(directory)!r}: the path does not exist{hint}")
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {str(directory)!r}: it is a file, a checkpoint "
                                      "is a directory")
    info_path = directory / INFO_FILE
    if not info_path.exists() and not info_path.is_symlink():  # a FIFO or a directory there: refused as one
        raise CheckpointNotFoundError(
            f"no checkpoint at {str(directory)!r}: the directory has no {INFO_FILE} (a DSpark checkpoint "
            f"is written by engine.save(path); it holds {_listing(directory)})")


def _listing(directory: Path, limit: int = 5) -> str:
    names = sorted(p.name for p in directory.iterdir())
    if not names:
        return "nothing"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
