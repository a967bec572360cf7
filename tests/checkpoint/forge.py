"""Writing a checkpoint's manifest to match its files as they are now: what someone crafting a
checkpoint does (the manifest is no signature), so that a test can reach the checks below it."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.checkpoint import manifest
from dspark.checkpoint.safe_metadata import load_metadata


def reseal(directory: Path) -> None:
    """Rewrite ``directory/manifest.json`` for the files there now (shard records from
    ``.metadata`` when it can be read safely, each whole file otherwise); the save id and summary
    from ``dspark.json`` when it can be read, else from the old manifest."""
    old = _json(directory / manifest.MANIFEST_FILE) or {}
    info = _json(directory / "dspark.json") or {}
    records: dict[str, list[tuple[int, int]]] = {}
    id_records: dict[str, tuple[int, int]] = {}
    try:
        storage_data = dict(load_metadata(directory / ".metadata").storage_data)
    except Exception:   # a crafted .metadata: its own check refuses it, the shard files are not reached
        storage_data = {}
    for index, record in storage_data.items():
        where = (int(record.offset), int(record.length))
        records.setdefault(record.relative_path, []).append(where)
        if index.fqn.startswith("save/") or record.relative_path not in id_records:
            id_records[record.relative_path] = where
    for path in directory.iterdir():
        if path.name != manifest.MANIFEST_FILE and path.is_file() and not path.is_symlink():
            records.setdefault(path.name, [])
    files = {}
    for name, file_records in records.items():
        if not (directory / name).is_file():
            continue
        try:
            files.update(manifest.hash_files(directory, {name: file_records}, id_records))
        except AssertionError:   # records past the file's end, overlapping: hashed whole
            files.update(manifest.hash_files(directory, {name: []}, {name: (0, 0)}))
    summary = {k: info.get(k, old.get("checkpoint", {}).get(k)) for k in manifest.SUMMARY_FIELDS}
    save_id = info.get("save_id") or old.get("save_id")
    manifest.write_manifest(directory, manifest.build_manifest(directory, save_id=save_id, summary=summary,
                                                               files=files))


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
