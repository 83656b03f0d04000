"""A hash of a split's content (:func:`data_fingerprint`): what a resume compares (:mod:`rlhf.run.resume_check`), and
part of the key of the tokenized data kept across runs (:mod:`rlhf.data.token_cache`)."""

from __future__ import annotations

import hashlib
import json


def data_fingerprint(dataset) -> str:
    """A hash of a split's content: column names, types and every value, in row order; the same however
    the table is chunked (in memory, or saved and loaded back by the other processes of a machine). The record of
    what truncation cut (:data:`rlhf.data.encoding.TRUNCATED`) is left out: it trains nothing."""
    import pyarrow as pa

    from rlhf.data.encoding import TRUNCATED

    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    if getattr(dataset, "_indices", None) is not None:  # a selection not yet written out: hash the rows it selects
        table = dataset.flatten_indices().data.table
    digest = hashlib.sha256()
    for name in sorted(set(table.column_names) - {TRUNCATED}):
        column = table.column(name)
        digest.update(f"{name}:{column.type};".encode())
        _hash_values(digest, column, pa)
    return digest.hexdigest()[:16]


def _hash_values(digest, column, pa) -> None:
    import numpy as np
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = pc.fill_null(pc.list_value_length(column), -1)
        digest.update(np.asarray(lengths.to_numpy(), dtype=np.int64).tobytes())
        _hash_values(digest, pc.list_flatten(column), pa)
    elif (pa.types.is_integer(kind) or pa.types.is_floating(kind)) and column.null_count == 0:
        digest.update(np.ascontiguousarray(column.to_numpy()).tobytes())
    else:
        digest.update(json.dumps(column.to_pylist(), default=str).encode())
