"""A kept artifact checked before anything of it is rendered: its rows against the chain head pinned
in ``benchmarks/results/HEADS``, and every result against its own figures.

[Note: pinned heads]
What an artifact under ``benchmarks/results/<name>/`` publishes is protected by a hash chain whose
head is pinned in ``benchmarks/results/HEADS`` (a line ``<head>  <name>``), a tracked file: git's
history shows every head ever pinned, and a pinned head is never changed (``pin_head`` refuses to;
``tests/bench/test_figures.py`` checks the file's history), so an edit to an artifact needs a visible
change of that line. The chain is

* for a ``dspark bench`` run, its ledger's own (``ledger.jsonl``, see [Note: kept rows] in
  :mod:`dspark.bench.ledger.rows`): every row verified, no seal, and its head equal to the pinned one
  (not merely reached: an artifact is never appended to);
* for a benchmark's own tables (``table*.json``, see [Note: table artifacts]) and for result rows
  kept without their ledger (``results.json`` of the artifacts made before ledgers were kept), one
  record per table header and per row, chained in ``chain.txt`` (a line ``<hash>  <file>#<index>``,
  written when the artifact is kept), so a changed, added or removed row is named.

Each result is then checked against itself (see [Note: consistent results] in
:mod:`dspark.bench.artifacts.consistency`). An artifact that fails anything is refused by name, and
``make figures`` writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.bench.analyse.analysis import annotate
from dspark.bench.artifacts.consistency import rederive, row_faults
from dspark.bench.artifacts.table import Table, load_table
from dspark.bench.ledger.chain import GENESIS, row_hash
from dspark.bench.ledger.ledger import Ledger

__all__ = ["CHAIN_FILE", "HEADS_FILE", "LEDGER_FILE", "MAX_KEPT_FILE_BYTES", "ArtifactRefused",
           "CheckedRows", "chain_kept_files", "check_artifact", "pin_artifact", "pin_head", "read_heads"]

HEADS_FILE = "HEADS"
CHAIN_FILE = "chain.txt"
LEDGER_FILE = "ledger.jsonl"
MAX_KEPT_FILE_BYTES = 16 * 2**20
"""The largest table or results file read: far above any kept one."""


class ArtifactRefused(ValueError):
    """An artifact whose chain or results do not hold; the message names it and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckedRows:
    """What an artifact publishes, verified."""

    rows: tuple[dict[str, Any], ...]
    """Results, as analysed now (the rows rendered)."""
    tables: tuple[Table, ...]
    head: str
    verified: str
    """What was verified, in a few words ("24 ledger rows", "7 table rows")."""


def read_heads(results_dir: Path) -> dict[str, str]:
    """``{artifact name: pinned head}`` from ``results_dir/HEADS`` ({} when there is none); a line
    that is not ``<64 hex digits>  <name>``, or a name pinned twice, is a ``ValueError``."""
    path = Path(results_dir) / HEADS_FILE
    heads: dict[str, str] = {}
    if not path.is_file():
        return heads
    for number, line in enumerate(path.read_text().splitlines(), 1):
        head, _, name = line.partition("  ")
        if len(head) != 64 or not all(c in "0123456789abcdef" for c in head) or not name:
            raise ValueError(f"{path}:{number}: {line!r:.100} is not '<64 hex digits>  <artifact name>'")
        if name in heads:
            raise ValueError(f"{path}:{number}: {name!r} is pinned twice")
        heads[name] = head
    return heads


def pin_head(results_dir: Path, name: str, head: str) -> None:
    """Add ``head  name`` to ``results_dir/HEADS`` (lines sorted by name). A name already pinned to
    another head is a ``ValueError``: a kept artifact's head never changes."""
    heads = read_heads(results_dir)
    if heads.get(name, head) != head:
        raise ValueError(f"{name!r} is already pinned to {heads[name]} in {HEADS_FILE}: a kept "
                         "artifact is never changed; keep the new measurement under a new name")
    heads[name] = head
    (Path(results_dir) / HEADS_FILE).write_text(
        "".join(f"{heads[n]}  {n}\n" for n in sorted(heads)))


def _read_json(path: Path) -> Any:
    size = path.stat().st_size
    if size > MAX_KEPT_FILE_BYTES:
        raise ArtifactRefused(f"{path}: {size} bytes, above the {MAX_KEPT_FILE_BYTES} a kept file may hold")
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:
        raise ArtifactRefused(f"{path}: not JSON ({type(exc).__name__})") from None


def _records(directory: Path, meta: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(label, record)`` of every table header and row and every kept result row, in order."""
    for rel in meta.get("tables", []):
        data = _read_json(directory / rel)
        table = data if isinstance(data, dict) else {}
        yield f"{rel}#0", {"file": rel, "columns": table.get("columns"), "caption": table.get("caption", "")}
        for index, row in enumerate(table.get("rows") or [], 1):
            yield f"{rel}#{index}", {"file": rel, "row": row}
    for rel in meta.get("results", []):
        data = _read_json(directory / rel)
        for index, row in enumerate(data if isinstance(data, list) else [data], 1):
            yield f"{rel}#{index}", {"file": rel, "row": row}


def _chain(directory: Path, meta: dict[str, Any]) -> list[tuple[str, str]]:
    prev, links = GENESIS, []
    for label, record in _records(directory, meta):
        prev = row_hash(prev, (record,))
        links.append((prev, label))
    return links


def chain_kept_files(directory: Path, meta: dict[str, Any]) -> str:
    """Write ``directory/chain.txt`` for the tables and results ``meta`` lists; returns the head.

    Example::

        pin_head(results, name, chain_kept_files(results / name, meta))
    """
    links = _chain(directory, meta)
    (directory / CHAIN_FILE).write_text("".join(f"{h}  {label}\n" for h, label in links))
    return links[-1][0] if links else GENESIS


def _file_chain_faults(directory: Path, meta: dict[str, Any]) -> tuple[str, list[str]]:
    kept_path = directory / CHAIN_FILE
    if not kept_path.is_file():
        return GENESIS, [f"it keeps no {CHAIN_FILE}: its rows were never chained"]
    kept = [tuple(line.split("  ", 1)) for line in kept_path.read_text().splitlines()]
    links = _chain(directory, meta)
    for (computed, label), line in zip(links, kept, strict=False):
        if len(line) != 2 or line[1] != label:
            return computed, [f"{label}: {CHAIN_FILE} lists {line[-1]!r} there: a row was added or "
                              "removed since it was kept"]
        if line[0] != computed:
            return computed, [f"{label}: its content does not match the hash {CHAIN_FILE} keeps for "
                              "it: it was changed after it was kept"]
    if len(links) != len(kept):
        return links[-1][0] if links else GENESIS, [
            f"{len(links)} rows for the {len(kept)} {CHAIN_FILE} keeps: a row was added or removed"]
    return links[-1][0] if links else GENESIS, []


def _ledger_rows(directory: Path, pinned: str) -> tuple[list[dict[str, Any]], str, list[str], int]:
    with Ledger(directory / LEDGER_FILE, create=False) as ledger:
        report = ledger.verify(head=pinned)
        faults = list(report.faults)
        if report.bad:
            faults.append(f"{len(report.bad)} ledger row(s) fail the hash chain, first {report.first_bad}")
        faults += [f"its rows carry a seal: {seal}" for seal in report.seals]
        if not faults and report.head != pinned:
            faults.append(f"{report.after_pinned} row(s) after the pinned head: a kept ledger is never "
                          "appended to")
        rows = [r.to_dict() for r in annotate(ledger.results(), history=ledger)] if not faults else []
    return rows, report.head, faults, report.rows


def check_artifact(directory: Path, meta: dict[str, Any], pinned: str | None) -> CheckedRows:
    """Verify the artifact in ``directory`` (its ``artifact.json`` read as ``meta``) against the head
    ``pinned`` for it, and check every result (see [Note: pinned heads]); ``ArtifactRefused`` naming
    what fails.

    Example::

        check_artifact(results / name, meta, read_heads(results).get(name)).rows
    """
    where = directory.name
    if pinned is None:
        raise ArtifactRefused(f"{where}: no head is pinned for it in {HEADS_FILE} (`python -m "
                              "dspark.bench.record` pins one as it keeps an artifact; for one kept by "
                              f"hand: python -m dspark.bench.figures --pin {where})")
    for rel in [*meta.get("results", []), *meta.get("tables", []),
                *([meta["ledger"]] if meta.get("ledger") else [])]:
        if not (directory / rel).is_file():
            raise ArtifactRefused(f"{where}: file {rel!r} is missing")
    if meta.get("ledger"):
        if meta["ledger"] != LEDGER_FILE or meta.get("results"):
            raise ArtifactRefused(f"{where}: \"ledger\" must be {LEDGER_FILE!r}, without \"results\"")
        rows, head, faults, count = _ledger_rows(directory, pinned)
        faults += [f"{LEDGER_FILE}: {fault}" for row in rows for fault in row_faults(row)]
        verified = f"{count} ledger rows"
    else:
        head, faults = _file_chain_faults(directory, meta)
        rows = []
        for rel in meta.get("results", []):
            data = _read_json(directory / rel)
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise ArtifactRefused(f"{where}: {rel}: not a JSON list of result rows")
            derived, found = rederive(data, where=rel)
            rows += derived
            faults += found
        if not faults and head != pinned:
            faults.append(f"its chain ends at {head}, {HEADS_FILE} pins {pinned}: a row was changed, "
                          "added or removed since it was kept")
        verified = f"{sum(1 for _ in _records(directory, meta))} kept rows"
    if faults:
        raise ArtifactRefused(f"{where}: " + "; ".join(faults))
    try:
        tables = tuple(load_table(directory / rel) for rel in meta.get("tables", []))
    except ValueError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None
    return CheckedRows(rows=tuple(rows), tables=tables, head=head, verified=verified)


def pin_artifact(results_dir: Path, name: str) -> str:
    """Chain an artifact kept by hand (``benchmarks/gpu_session.sh``'s, say) and pin its head in
    ``results_dir/HEADS``: a ledger's head once its rows verify, with no seal, or the head of
    ``chain.txt``, written now for its tables and results. Returns the head.

    Example::

        pin_artifact(Path("benchmarks/results"), "2026-12-08-h100")
    """
    directory = Path(results_dir) / name
    meta = json.loads((directory / "artifact.json").read_text())
    if meta.get("ledger"):
        with Ledger(directory / meta["ledger"], create=False) as ledger:
            report = ledger.verify()
        if not report.ok or report.seals:
            first = (report.faults or report.bad or report.seals)[0]
            raise ArtifactRefused(f"{name}: its ledger rows do not verify ({first})")
        head = report.head
    else:
        head = chain_kept_files(directory, meta)
    pin_head(Path(results_dir), name, head)
    return head
