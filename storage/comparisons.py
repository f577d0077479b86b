"""The compare flow's Parquet output: one `comparisons/<comparison_id>` dataset per comparison (schema
`schemas.COMPARISONS`, long form), so DuckDB's `comparisons` / `comparisons_all` views pivot any of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from cse.storage import schemas
from cse.storage.catalog import refresh_catalog
from cse.storage.datasets import write_dataset
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest


def write_comparison(
    root: DataRoot, comparison_id: str, rows: Sequence[Mapping[str, Any]], params: Mapping[str, Any] | None = None
) -> Manifest:
    """Write a comparison table as the `comparisons` dataset `comparison_id` and refresh the catalog.

    Args:
        root: the data root.
        comparison_id: the dataset key of the comparison.
        rows: one mapping per compared run; keys outside the comparison schema are dropped.
        params: parameters recorded in the manifest.

    Returns:
        The manifest of the written dataset.
    """
    table = pa.Table.from_pylist(
        [{f.name: r.get(f.name) for f in schemas.COMPARISONS} for r in rows], schema=schemas.COMPARISONS
    )
    m = write_dataset(
        root, "comparisons", comparison_id, [table], schemas.COMPARISONS, params=dict(params or {}), inputs={}
    )
    refresh_catalog(root)
    return m
