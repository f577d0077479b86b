"""The data root's layout. Only this module knows where datasets live.

    <data_root>/
      downloads/<name>                      canonical source files fetched from the network
      datasets/<kind>/<key>/part-*.parquet  one folder per dataset, addressed by its key
      datasets/<kind>/<key>/manifest.json   written last: its presence marks the dataset complete
      datasets/<kind>/<key>.shards/         finished shards of a dataset still being built
      datasets/<kind>/<key>.lock            held (flock) by the one process building the dataset
      catalog.duckdb                        DuckDB views over the Parquet outputs
"""

from __future__ import annotations

from pathlib import Path

from storage.atomic import clean_temporaries
from storage.locks import exclusive
from storage.manifest import Manifest, read_manifest_if_complete

KINDS = ("wiki1m", "nli", "sts", "tokens", "corruption", "evaluations", "comparisons")


class DataRoot:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()

    @classmethod
    def visible(cls, path: str | Path, what: str) -> DataRoot:
        """The data root at `path` as a shard task on another worker sees it; a worker that does not see it
        (no shared filesystem) fails naming `what` it was building."""
        if not Path(path).is_dir():
            raise FileNotFoundError(f"data root {path} of {what} is not visible here: every worker must see the "
                                    "flow's data root at the same path (a shared filesystem)")
        return cls(path)

    def __repr__(self) -> str:
        return f"DataRoot({str(self.root)!r})"

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def catalog_path(self) -> Path:
        return self.root / "catalog.duckdb"

    def kind_dir(self, kind: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown dataset kind {kind!r}; known: {', '.join(KINDS)}")
        return self.root / "datasets" / kind

    def dataset_dir(self, kind: str, key: str) -> Path:
        return self.kind_dir(kind) / key

    def shards_dir(self, kind: str, key: str) -> Path:
        """Work folder of a dataset built in shards (`<key>.shards` beside it): finished shards survive
        a crash there until the dataset is published. It has no manifest, so it is never a dataset."""
        return self.kind_dir(kind) / f"{key}.shards"

    def building(self, kind: str, key: str):
        """The dataset's build lock (`storage.locks.exclusive` on `<key>.lock` beside it): concurrent flows that
        need the same dataset (the children of a sweep on several workers) build it once; the others wait here
        and then find it complete."""
        return exclusive(self.kind_dir(kind) / f"{key}.lock", f"dataset {kind}/{key}")

    def find(self, kind: str, key: str) -> Manifest | None:
        """The manifest of a complete dataset with this key, or None (a cache miss)."""
        return read_manifest_if_complete(self.dataset_dir(kind, key))

    def require(self, kind: str, key: str) -> Manifest:
        m = self.find(kind, key)
        if m is None:
            raise FileNotFoundError(
                f"dataset {kind}/{key} not found under {self.root}: run the stage that produces it first"
            )
        return m

    def list(self, kind: str) -> list[tuple[Path, Manifest]]:
        """Every complete dataset of a kind, oldest first."""
        d = self.kind_dir(kind)
        found = []
        if d.is_dir():
            for sub in d.iterdir():
                if sub.is_dir() and (m := read_manifest_if_complete(sub)) is not None:
                    found.append((sub, m))
        return sorted(found, key=lambda pm: pm[1].created)

    def clean(self) -> int:
        """Remove leftovers of killed writers."""
        return clean_temporaries(self.root)
