"""Generator datasets: a fitted masked LM published as a dataset folder, `datasets/generator/<key>/`.

The folder is what `AutoModelForMaskedLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` load
(config.json, the weights, the tokenizer files) plus `heldout.json` (the held-out split of the fit) and the manifest.
It is written like every dataset: into a temporary sibling, published with its manifest by one rename (a killed fit
leaves only a `.tmp-*` folder, removed by the next run), addressed by its key, verified before a cache hit. The
manifest lists every file with its size and sha256 (`files`, `file_sizes`, `file_hashes`, `content_hash`); there
are no Parquet parts, so `rows` is 0 and no Arrow copy is made (storage/integrity.py checks sizes, and hashes with
`full`). `GENERATOR_PREFIX` + key names such a dataset wherever a generator is expected (`corrupt.generator`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cse.storage.atomic import atomic_dir, write_json
from cse.storage.hashing import combine_hashes, sha256_file
from cse.storage.layout import DataRoot
from cse.storage.manifest import MANIFEST_NAME, Manifest

KIND = "generator"
GENERATOR_PREFIX = "generator:"
HELDOUT_FILE = "heldout.json"


def publish_model_folder(
    root: DataRoot,
    key: str,
    write: Callable[[Path], None],
    *,
    heldout: Mapping[str, Any],
    params: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str] | None = None,
    stats: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
) -> Manifest:
    """Publish the files `write(folder)` saves (a model and its tokenizer) and `heldout` (as `heldout.json`) as
    dataset `generator/<key>`, atomically, with a manifest recording every file's size and sha256."""
    final = root.dataset_dir(KIND, key)
    with atomic_dir(final) as tmp:
        write(tmp)
        write_json(dict(heldout), tmp / HELDOUT_FILE)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
        hashes = {f: sha256_file(tmp / f) for f in files}
        m = Manifest(
            kind=KIND,
            key=key,
            rows=0,
            files=files,
            content_hash=combine_hashes([hashes[f] for f in files]),
            file_sizes={f: (tmp / f).stat().st_size for f in files},
            file_hashes=hashes,
            params=dict(params or {}),
            inputs=dict(inputs or {}),
            stats=dict(stats or {}),
            source=dict(source or {}),
        )
        m.write(tmp)
    return m


def generator_dataset(root: DataRoot, spec: str) -> Manifest | None:
    """The manifest of the generator dataset `spec` names: `generator:<key>`, or a folder that is one (under the
    data root's `datasets/generator/`); None when `spec` is neither. An unknown key raises FileNotFoundError."""
    if spec.startswith(GENERATOR_PREFIX):
        key = spec[len(GENERATOR_PREFIX) :].strip()
        if not key:
            raise ValueError(f"{spec!r}: name a generator dataset key after {GENERATOR_PREFIX!r}")
        m = root.find(KIND, key)
        if m is None:
            raise FileNotFoundError(
                f"generator dataset {key!r} not found under {root.kind_dir(KIND)}: run the "
                "fit-generator stage first (or give the folder of a masked LM)"
            )
        return m
    path = Path(spec).expanduser()
    if path.is_dir() and path.resolve().parent == root.kind_dir(KIND):
        return root.find(KIND, path.resolve().name)
    return None
