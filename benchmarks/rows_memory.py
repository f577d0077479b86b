"""Peak memory of a Wiki1M-sized training job's rows: loading tokens + a 4-variant corruption and drawing batches,
memory-mapped (this tree) against materialised (the code before the rows were memory-mapped, at a git commit).

    nice -n 10 python -m benchmarks.rows_memory [--rows 1000000] [--variants 4] [--batches 500] [--batch-size 64]
        [--data-root DIR] [--old-ref e721e3a] [--paths old,new]

Data (built once under --data-root, default $TMPDIR/cse-rows-memory, and reused): the 11,913 sentences of the
Wiki1M sample in ../shared/data tokenised with the bert-base-uncased vocabulary (the packaged MiniLM's tokenizer,
max_length 32), replicated to --rows rows (ids 0..rows-1), written as a `tokens` dataset in parts of 50,000 rows;
and a `corruption` dataset of --variants variants per row in the corruption stage's layout (row i's variants
0..V-1 next to each other, parts of 50,000 sentences), each replacing 30 % of the non-special tokens by random ids
(synthetic: a real generator would take days on a CPU for 4,000,000 sentences; the rows' shape and sizes are the
same). Both are written by `cse.storage.datasets.write_dataset`, so they carry their Arrow copies.

Each path runs in a fresh process: `load_token_rows` + `load_corruption_rows` + `TrainingRows` (unsupervised, two
views), then --batches batches of --batch-size rows in the epoch order of epochs 0 and 1 (half each: all four variants
are read). The old path runs the same calls from the tree of --old-ref (`git archive`; its top-level packages on the
child's PYTHONPATH, as that tree predates the package `cse`) on the same data root. A thread samples
/proc/self/status every 20 ms. Printed per path (MiB), also right after the imports: `peak_rss` (VmHWM: everything
resident, memory-mapped file pages included), `peak_anon` (private memory: what the kernel cannot drop or share),
`peak_file` (file pages mapped in: the libraries' code and, on the new path, the dataset pages the batches touched:
page cache, shared and reclaimable); load and batch seconds. The batches' checksum must agree between the paths (the
same rows, variants and padding). One JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
PART_ROWS = 50_000
OLD_REF = "e721e3a"  # the last commit whose training rows were materialised


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in KiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


class Sampler(threading.Thread):
    """Peak RssAnon / RssFile, sampled every 20 ms (the kernel keeps a high-water mark of the total only)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            s = _status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ the data


def build_data(data_root: Path, rows: int, variants: int) -> tuple[str, str]:
    """(tokens key, corruption key) of the benchmark's datasets under `data_root`, built when missing."""
    from cse.storage import schemas
    from cse.storage.datasets import write_dataset
    from cse.storage.layout import DataRoot

    root = DataRoot(data_root)
    tokens_key, corruption_key = f"bench-{rows}", f"bench-{rows}-v{variants}"
    if root.find("tokens", tokens_key) and root.find("corruption", corruption_key):
        return tokens_key, corruption_key
    sample = Sample.tokenized(SHARED_DATA / "wiki1m_head.txt")
    t0 = time.perf_counter()
    if not root.find("tokens", tokens_key):
        write_dataset(
            root,
            "tokens",
            tokens_key,
            sample.token_parts(rows),
            schemas.TOKENS,
            params={"benchmark": "rows_memory", "rows": rows, "sample": "wiki1m_head.txt"},
        )
    if not root.find("corruption", corruption_key):
        write_dataset(
            root,
            "corruption",
            corruption_key,
            sample.corruption_parts(rows, variants),
            schemas.CORRUPTION,
            params={"benchmark": "rows_memory", "rows": rows, "variants": variants, "mask_ratio": 0.3},
        )
    print(f"built the benchmark datasets under {data_root} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return tokens_key, corruption_key


def _ranges(starts, lengths):
    """The concatenation of arange(s, s + n) for every (s, n)."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)


def _lists(lengths, flat, dtype):
    """A pyarrow list array of `flat` cut at `lengths`, its values as `dtype`."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype)))


class Sample:
    """The tokenised sentence sample the benchmark's rows repeat: row i is sentence i mod the sample's size."""

    def __init__(self, n_lines: int, lengths, flat, special):
        self.n_lines, self.lengths, self.flat, self.special = n_lines, lengths, flat, special
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])

    @classmethod
    def tokenized(cls, path: Path) -> Sample:
        """The lines of `path` through the packaged MiniLM's tokenizer (max length 32; a blank line as one space)."""
        from cse.models.loading import PACKAGED_MINILM, load_tokenizer

        lines = path.read_text().splitlines()
        tok = load_tokenizer(PACKAGED_MINILM)
        encoded = tok([s if s.strip() else " " for s in lines], truncation=True, max_length=32)["input_ids"]
        flat = np.concatenate([np.asarray(e, np.int32) for e in encoded])
        return cls(len(lines), np.array([len(e) for e in encoded]), flat, np.isin(flat, tok.all_special_ids))

    def sentences(self, start: int, stop: int):
        """(lengths, flat ids, special mask) of rows [start, stop): sentence j of the sample repeated."""
        src = np.arange(start, stop) % self.n_lines
        lengths = self.lengths[src]
        take = _ranges(self.offsets[src], lengths)
        return lengths, self.flat[take], self.special[take]

    def token_parts(self, rows: int):
        """The tokens dataset's parts of `rows` rows."""
        from cse.storage import schemas

        for start in range(0, rows, PART_ROWS):
            stop = min(rows, start + PART_ROWS)
            lengths, flat, _ = self.sentences(start, stop)
            yield pa.table(
                {
                    "id": pa.array(np.arange(start, stop)),
                    "column": pa.array(["text"] * (stop - start)),
                    "input_ids": _lists(lengths, flat, np.int32),
                    "length": pa.array(lengths.astype(np.int16)),
                },
                schema=schemas.TOKENS,
            )

    def corruption_parts(self, rows: int, variants: int):
        """The corruption dataset's parts: `variants` random corruptions of each row (30 % of its non-special
        tokens masked, each replaced by a random id), seeded once for the whole dataset."""
        rng = np.random.default_rng(0)
        for start in range(0, rows, PART_ROWS):
            yield self.corruption_part(start, min(rows, start + PART_ROWS), variants, rng)

    def corruption_part(self, start: int, stop: int, variants: int, rng):
        """One corruption part: rows [start, stop), each row's variants next to each other (the stage's order)."""
        from cse.storage import schemas

        n = stop - start
        lengths, flat, spec = self.sentences(start, stop)
        row_of = np.repeat(np.arange(n), lengths)
        masks, corrupted, labels = [], [], []
        for _ in range(variants):
            masks.append((rng.random(len(flat)) < 0.3) & ~spec)
            corrupted.append(np.where(masks[-1], rng.integers(1000, 30000, len(flat)), flat).astype(np.int32))
            labels.append((corrupted[-1] != flat).astype(np.int8))
        # the stage's order: row i's variants 0..V-1 next to each other
        order = np.arange(n * variants).reshape(variants, n).T.ravel()
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        take = _ranges((order // n) * len(flat) + starts[order % n], lengths[order % n])

        def interleave(arrays):
            return np.concatenate(arrays)[take]

        def per_row(arrays):
            """Each (row, variant)'s sum of `arrays`' values, in the stage's order."""
            return pa.array(np.concatenate([np.bincount(row_of, a, n) for a in arrays])[order].astype(np.int16))

        all_lengths = np.tile(lengths, variants)[order]
        return pa.table(
            {
                "id": pa.array(np.tile(np.arange(start, stop), variants)[order]),
                "column": pa.array(["text"] * (n * variants)),
                "variant": pa.array(np.repeat(np.arange(variants), n)[order].astype(np.int16)),
                "input_ids": _lists(all_lengths, interleave([flat] * variants), np.int32),
                "corrupted_ids": _lists(all_lengths, interleave(corrupted), np.int32),
                "labels": _lists(all_lengths, interleave(labels), np.int8),
                "n_masked": per_row(masks),
                "n_replaced": per_row(labels),
            },
            schema=schemas.CORRUPTION,
        )


# ------------------------------------------------------------------------------------------------ one measurement


def package_prefix(tree: str | Path) -> str:
    """How the code of `tree` is imported: `cse.` (this layout: the installed package) or `` (a tree from before the
    packages moved under `cse`: top-level `storage`, `training`, found through PYTHONPATH, `run_path`)."""
    return "cse." if (Path(tree) / "cse" / "__init__.py").is_file() else ""


def measure(tree: str, data_root: str, tokens_key: str, corruption_key: str, batches: int, batch_size: int) -> dict:
    """Load the rows and draw batches with the code of `tree` (in this fresh process); the memory it took."""
    import importlib

    import torch  # noqa: F401 - imported before the baseline, as every path needs it (numpy too)

    prefix = package_prefix(tree)
    DataRoot = importlib.import_module(f"{prefix}storage.layout").DataRoot
    training_data = importlib.import_module(f"{prefix}storage.training_data")
    load_corruption_rows, load_token_rows = training_data.load_corruption_rows, training_data.load_token_rows
    rows_module = importlib.import_module(f"{prefix}training.rows")
    TrainingRows, epoch_order = rows_module.TrainingRows, rows_module.epoch_order

    sampler = Sampler()
    after_imports = _status()
    sampler.start()
    root = DataRoot(data_root)
    t0 = time.perf_counter()
    tokens = load_token_rows(root, tokens_key, ("text",))
    rows = TrainingRows(tokens, load_corruption_rows(root, corruption_key, tokens), supervised=False, pad_id=0)
    loaded = time.perf_counter()
    after_load = _status()
    checksum = 0
    for epoch in (0, 1):
        order = epoch_order(len(rows), seed=42, epoch=epoch)
        for b in range(batches // 2):
            batch = rows.batch(order[b * batch_size : (b + 1) * batch_size], epoch)
            checksum += int(batch.corrupted_ids.sum()) + int(batch.input_ids.sum())
    done = time.perf_counter()
    sampler.stop.set()
    sampler.join()
    end = _status()
    mib = lambda kib: round(kib / 1024, 1)
    return {
        "rows": len(rows),
        "variants": rows.corruption.variants,
        "rss_after_imports": mib(after_imports["VmRSS"]),
        "anon_after_imports": mib(after_imports["RssAnon"]),
        "file_after_imports": mib(after_imports["RssFile"]),
        "rss_after_load": mib(after_load["VmRSS"]),
        "peak_rss": mib(end["VmHWM"]),
        "peak_anon": mib(sampler.peak["RssAnon"]),
        "peak_file": mib(sampler.peak["RssFile"]),
        "load_seconds": round(loaded - t0, 1),
        "batch_seconds": round(done - loaded, 1),
        "batches": 2 * (batches // 2),
        "batch_size": batch_size,
        "checksum": checksum,
        "code": str(Path(sys.modules[load_token_rows.__module__].__file__).parents[1]),
    }


def run_path(name: str, tree: Path, args, keys: tuple[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", str(tree), "--data-root", str(args.data_root)]
    cmd += ["--tokens-key", keys[0], "--corruption-key", keys[1]]
    cmd += ["--batches", str(args.batches), "--batch-size", str(args.batch_size)]
    env = {**os.environ, "PYTHONPATH": str(tree)} if not package_prefix(tree) else None  # an old tree's packages
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the {name} path failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"{name:3s}: peak RSS {result['peak_rss']:8.1f} MiB (anon {result['peak_anon']:.1f}, file pages "
        f"{result['peak_file']:.1f}); after imports {result['rss_after_imports']:.1f} (anon "
        f"{result['anon_after_imports']:.1f}, file {result['file_after_imports']:.1f}); load {result['load_seconds']}s, "
        f"{result['batches']} batches {result['batch_seconds']}s",
        file=sys.stderr,
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--variants", type=int, default=4)
    p.add_argument("--batches", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--data-root", type=Path, default=Path(tempfile.gettempdir()) / "cse-rows-memory")
    p.add_argument("--old-ref", default=OLD_REF, help="git commit of the materialised path")
    p.add_argument("--paths", default="old,new")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--tokens-key", help=argparse.SUPPRESS)
    p.add_argument("--corruption-key", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        keys = (args.tokens_key, args.corruption_key)
        print(json.dumps(measure(args.child, str(args.data_root), *keys, args.batches, args.batch_size)))
        return
    keys = build_data(args.data_root, args.rows, args.variants)
    results = {}
    with tempfile.TemporaryDirectory(prefix="cse-old-tree-") as old_tree:
        for name in args.paths.split(","):
            tree = REPO_ROOT
            if name == "old":
                archive = subprocess.run(
                    ["git", "archive", args.old_ref], cwd=REPO_ROOT, capture_output=True, check=True
                )
                subprocess.run(["tar", "-x", "-C", old_tree], input=archive.stdout, check=True)
                tree = Path(old_tree)
            results[name] = run_path(name, tree, args, keys)
    if {"old", "new"} <= results.keys() and results["old"]["checksum"] != results["new"]["checksum"]:
        raise SystemExit("the two paths drew different batches")
    print(json.dumps({"rows": args.rows, "variants": args.variants, "old_ref": args.old_ref, **results}))


if __name__ == "__main__":
    main()
