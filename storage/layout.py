"""The data root's layout. Only this module knows where datasets live.

<data_root>/
  downloads/<name>                      canonical source files fetched from the network
  datasets/<kind>/<key>/part-*.parquet  one folder per dataset, addressed by its key
  datasets/<kind>/<key>/hf/             its memory-mappable Arrow copy (HF `save_to_disk` layout; arrow_copy.py)
  datasets/<kind>/<key>/manifest.json   written last: its presence marks the dataset complete
  datasets/generator/<key>/             a fitted masked LM (config, weights, tokenizer files; no Parquet)
  datasets/<kind>/<key>.shards/         finished shards of a dataset still being built
  datasets/<kind>/<key>.lock            held (flock) by the one process building the dataset
  catalog.duckdb                        DuckDB views over the Parquet outputs
  quarantine/<kind>/<key>-<time>/       damaged datasets moved aside (never deleted), with quarantine.json
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from cse.storage.atomic import TMP_PREFIX, clean_temporaries, process_alive, remove_path, temporary_owner
from cse.storage.locks import exclusive, try_exclusive
from cse.storage.manifest import Manifest, ManifestError, read_manifest_if_complete
from cse.storage.paths import check_key

if TYPE_CHECKING:
    from cse.storage.integrity import Quarantined

log = logging.getLogger(__name__)

KINDS = ("wiki1m", "nli", "sts", "transfer", "tokens", "corruption", "evaluations", "comparisons", "generator")
NO_PARQUET_KINDS = ("generator",)  # datasets of model files (storage/generators.py), not Parquet parts


class DataRoot:
    """The data root folder: the layout of its datasets, downloads and catalog, and access to their manifests."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()

    @classmethod
    def visible(cls, path: str | Path, what: str) -> DataRoot:
        """The data root at `path` as a shard task on another worker sees it; a worker that does not see it
        (no shared filesystem) fails naming `what` it was building."""
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"data root {path} of {what} is not visible here: every worker must see the "
                "flow's data root at the same path (a shared filesystem)"
            )
        return cls(path)

    def __repr__(self) -> str:
        return f"DataRoot({str(self.root)!r})"

    @classmethod
    def of_dataset(cls, folder: str | Path) -> DataRoot:
        """The data root holding the dataset folder `folder` (`<root>/datasets/<kind>/<key>`, a `DatasetRef.path`);
        a ValueError for a path of another shape."""
        path = Path(folder)
        if len(path.parents) < 3 or path.parents[1].name != "datasets":
            raise ValueError(f"{folder} is not a dataset folder (<data root>/datasets/<kind>/<key>)")
        return cls(path.parents[2])

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
        """The folder of dataset `kind/key`; a key that is not one safe name (`cse.storage.paths.check_key`: no `/`, no
        `..`) is refused, so no key from a user reaches outside the kind's folder."""
        return self.kind_dir(kind) / check_key(key, f"{kind} dataset key")

    def shards_dir(self, kind: str, key: str) -> Path:
        """Work folder of a dataset built in shards (`<key>.shards` beside it): finished shards survive
        a crash there until the dataset is published. It has no manifest, so it is never a dataset."""
        return self.kind_dir(kind) / f"{check_key(key, f'{kind} dataset key')}.shards"

    def lock_path(self, kind: str, key: str) -> Path:
        return self.kind_dir(kind) / f"{check_key(key, f'{kind} dataset key')}.lock"

    @contextlib.contextmanager
    def building(self, kind: str, key: str) -> Iterator[None]:
        """The dataset's build lock (`cse.storage.locks.exclusive` on `<key>.lock` beside it): concurrent flows that
        need the same dataset (the children of a sweep on several workers) build it once; the others wait here
        and then find it complete. Once held, the leftovers of killed builders of the kind are removed
        (`clean_stale`)."""
        with exclusive(self.lock_path(kind, key), f"dataset {kind}/{key}"):
            self.clean_stale(kind, key)
            try:
                yield
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # the bare error names neither the dataset nor where it was written: say both (nothing was published)
                raise OSError(
                    e.errno,
                    f"{e.strerror or 'no space left on device'} while building dataset {kind}/{key} in "
                    f"{self.kind_dir(kind)} ({e.filename or 'a file of the build'}); nothing was published: "
                    "free space there and rerun the stage",
                ) from e

    def clean_stale(self, kind: str, held_key: str | None = None) -> list[Path]:
        """Remove the `.tmp-*` leftovers of killed writers of this kind (dataset folders being built, shard files):
        those of `held_key`, whose build lock the caller holds, and those of any other key whose build lock is free
        and whose writer process is dead. A live writer's temporaries are never touched (it holds the lock)."""
        d = self.kind_dir(kind)
        if not d.is_dir():
            return []
        candidates: list[tuple[str, Path]] = []  # (key, leftover)
        for p in d.iterdir():
            if p.name.startswith(TMP_PREFIX) and (owner := temporary_owner(p)) is not None:
                candidates.append((owner[0], p))
            elif p.name.endswith(".shards") and p.is_dir():
                key = p.name[: -len(".shards")]
                candidates += [(key, q) for q in p.iterdir() if q.name.startswith(TMP_PREFIX)]
        removed: list[Path] = []
        for key, p in sorted(candidates, key=lambda kp: kp[0]):
            if key != held_key:
                owner = temporary_owner(p)
                if owner is None or process_alive(owner[1]):
                    continue
                with try_exclusive(self.lock_path(kind, key)) as free:
                    if not free:
                        continue
                    remove_path(p)
            else:
                remove_path(p)
            removed.append(p)
        if removed:
            log.warning(
                "removed %d leftover temporaries of killed %s builds: %s",
                len(removed),
                kind,
                ", ".join(str(p) for p in removed),
            )
        return removed

    def find(self, kind: str, key: str) -> Manifest | None:
        """The manifest of a complete dataset with this key, or None (a cache miss). Not verified: stages reuse a
        dataset through `reuse`, which checks it first."""
        try:
            return read_manifest_if_complete(self.dataset_dir(kind, key))
        except ManifestError:
            return None

    def reuse(
        self, kind: str, key: str, *, full: bool = False, quarantine: bool = True
    ) -> tuple[Manifest | None, Quarantined | None]:
        """A cache hit that verifies what it reuses: `(manifest, None)` for an intact dataset, `(None, None)` when
        there is none, and `(None, Quarantined)` when one was there but damaged (`cse.storage.integrity.check_dataset`;
        `full` adds the content hashes): it is moved to the quarantine, so the caller rebuilds it. Call it holding
        the dataset's build lock (`building`). With `quarantine=False` a damaged dataset is only reported as a miss.
        When only its Arrow copy (`hf/`) is damaged, the copy is quarantined and rebuilt from the intact Parquet parts
        and the dataset is reused: `(manifest, Quarantined)` (the record of the copy)."""
        from cse.storage.integrity import check_dataset, copy_only, repair_arrow_copy
        from cse.storage.integrity import quarantine as move_aside

        folder = self.dataset_dir(kind, key)
        if not folder.exists():
            return None, None
        problems = check_dataset(folder, kind, key, full=full)
        if not problems:
            return Manifest.read(folder), None
        if not quarantine:
            return None, None
        if copy_only(folder, problems):
            repaired, record = repair_arrow_copy(self.root, folder, kind, key, problems)
            if not (problems := check_dataset(folder, kind, key, full=full)):  # the parts too, now nothing hides them
                return repaired, record
        return None, move_aside(self.root, folder, kind, key, problems)

    def verify(self, kind: str, key: str, full: bool = True) -> Manifest:
        """The manifest of an intact dataset; `cse.storage.integrity.DatasetDamaged` naming the file otherwise."""
        from cse.storage.integrity import DatasetDamaged, check_dataset

        m = self.require(kind, key)
        if problems := check_dataset(self.dataset_dir(kind, key), kind, key, full=full):
            raise DatasetDamaged(problems)
        return m

    def dataset_dirs(self, kind: str) -> list[Path]:
        """Every dataset folder of a kind, complete or not (not the `.tmp-*` builds and `.shards` work folders):
        a folder there without a readable manifest is damaged, since only complete datasets are ever published."""
        d = self.kind_dir(kind)
        if not d.is_dir():
            return []
        return sorted(
            p
            for p in d.iterdir()
            if p.is_dir() and not p.name.startswith(TMP_PREFIX) and not p.name.endswith(".shards")
        )

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
                if not sub.is_dir() or sub.name.startswith(TMP_PREFIX):
                    continue
                try:
                    m = read_manifest_if_complete(sub)
                except ManifestError as e:  # damaged: skipped here, reported by `cse verify` and the catalog
                    from cse.storage.integrity import warn_damaged_once

                    warn_damaged_once(f"{kind}/{sub.name}", str(e))
                    continue
                if m is not None:
                    found.append((sub, m))
        return sorted(found, key=lambda pm: pm[1].created)

    def clean(self) -> int:
        """Remove leftovers of killed writers."""
        return clean_temporaries(self.root)
