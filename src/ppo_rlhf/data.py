"""Reading data rows from JSONL, Parquet or a ``datasets`` folder, with errors that say where.

A row is a dict.  A malformed row names the file and line; a missing field names the field,
the file and the fields the row does have.
"""

from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and line, for JSONL)."""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_number}: each line must be a JSON object, got {type(row).__name__}")
            row["_source"] = f"{path}:{line_number}"
            rows.append(row)
    return rows


def load_rows(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """All rows of a JSONL / Parquet file or a ``save_to_disk`` folder, checked for ``required`` fields."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data not found: {path}")
    if path.is_dir():
        from datasets import load_from_disk

        dataset = load_from_disk(str(path))
        if hasattr(dataset, "keys"):  # a DatasetDict: take "train"
            if "train" not in dataset:
                raise DataError(f"{path} holds splits {list(dataset.keys())}; point to one split or add 'train'")
            dataset = dataset["train"]
        rows = [dict(r, _source=f"{path}[{i}]") for i, r in enumerate(dataset)]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [dict(r, _source=f"{path}[row {i}]") for i, r in enumerate(pq.read_table(path).to_pylist())]
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path)
    else:
        raise DataError(f"{path}: unsupported data format '{path.suffix}'; use .jsonl, .parquet or a save_to_disk folder")
    if not rows:
        raise DataError(f"{path} holds no rows")
    for row in rows:
        missing = [field for field in required if field not in row or row[field] is None]
        if missing:
            fields = sorted(k for k in row if k != "_source")
            raise DataError(f"{row['_source']}: missing field '{missing[0]}' (the row has: {', '.join(fields)})")
    return rows
