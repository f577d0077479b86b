"""Protocol 2's STS runs on a machine without the data stages: a GPU node with no network, no Prefect and no DuckDB
catalog, and a limit on what can be carried to it.

    python -m benchmarks.evidence_device export --home H --dest DIR [--methods M1,M2] [--seeds 0,1,2]
    python -m benchmarks.evidence_device run --src DIR --home H2 --part NAME [--device cuda] [--methods] [--seeds]

`export` (here, beside the data root of `benchmarks.evidence_v2 --home H`) writes into DIR everything the STS runs
need: each run's resolved `TrainConfig` at the knob its power checks chose, its training rows and held-out probe rows
(the real corruption of its seed, made here by the protocol's generator), the STS table of the dev evaluation, and
the packaged MiniLM with its weights rounded to fp16 (45 MB instead of 91 MB: a transfer of 64 MiB holds it with the
code). `run` (there) restores the backbone as fp32 from that copy once, then trains the runs not yet in a part of
`--home`, exactly as `benchmarks.evidence_v2` trains them (`train_sts`: the same loop, evaluations and probe), and
writes each record as soon as it ends into `<home>/parts/<part>.json`, with `device` (`cuda: <name>`) and
`backbone_weights`. Those parts are merged beside the CPU's (`benchmarks.evidence_v2 --merge --home H2`, or copy them
into H's parts): the GPU records are a set of their own, summarised and rendered apart, never paired with a CPU run.

`--steps N` rehearses the whole path in N steps (on CPU: `--device cpu`); its records are refused by the merge.
"""

from __future__ import annotations

import argparse
import functools
import json
import lzma
import os
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import evidence_v2 as v2
from benchmarks.evidence_base import parse_methods, parse_seeds, stsb_dev, use_home
from benchmarks.machine import command_line

BACKBONE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
HALF = "model.fp16.safetensors"


def export_backbone(source: Path, dest: Path) -> None:
    """`source`'s config and tokenizer files and its weights rounded to fp16 (floating tensors; others as they are)."""
    import torch

    _copy_model(source, "model.safetensors", dest, HALF, torch.float16)


def restore_backbone(half: Path) -> Path:
    """The fp32 model folder of an exported backbone (`<half>-fp32`, made once: a process that finds it complete
    reuses it; several processes may race to make it, each into its own folder, the first rename wins)."""
    import torch

    full = half.with_name(half.name + "-fp32")
    if (full / "model.safetensors").is_file():
        return full
    tmp = half.with_name(f"{half.name}-fp32.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _copy_model(half, HALF, tmp, "model.safetensors", torch.float32)
    try:
        tmp.rename(full)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return full


def _copy_model(source: Path, weights: str, dest: Path, dest_weights: str, dtype) -> None:
    """Copy a model folder's config and tokenizer files, and its `weights` file as `dest_weights` with every floating
    tensor cast to `dtype`."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in BACKBONE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    tensors = load_file(str(source / weights))
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, str(dest / dest_weights))


def export(home: Path, dest: Path, methods: list[str], seeds: list[int] | None, command: str = "") -> dict[str, Any]:
    """Write DIR/runs.json, DIR/rows-<corruption key>.pkl.xz, DIR/sts.pkl.xz and DIR/backbone (see the module's text)."""
    from benchmarks.evidence_base import Bench
    from cse.models.loading import load_tokenizer, resolve_model_path
    from cse.storage.evaluations import load_sts_input
    from cse.training.job import load_training_rows

    records = v2.parts(home).records()
    generator = v2.fit_v2_generator(Bench(None))
    bench = Bench(f"generator:{generator['key']}")
    dest.mkdir(parents=True, exist_ok=True)
    runs = []
    for method, arm_name, seed in v2.expected_sts(methods, seeds):
        choice = v2.chosen_knob(records, method)
        if choice is None:
            raise SystemExit(f"{method}: its power checks are not all done in {home}; run them first")
        arm = next(a for a in v2.ARMS[method] if a.name == arm_name)
        cfg = v2.train_config(bench, method, arm, seed, choice[0], v2.PROTOCOL_V2["steps"], bench.generator())
        tokens = bench.tokens(cfg.dataset, cfg)
        corruption = bench.corruption(tokens, cfg)
        rows_file = dest / f"rows-{corruption.key}.pkl.xz"
        if not rows_file.is_file():
            pad = load_tokenizer(cfg.backbone).pad_token_id
            rows, _ = load_training_rows(cfg, bench.root, tokens, corruption, None, pad)
            all_rows, heldout = bench.heldout(tokens, corruption, pad, v2.PROTOCOL_V2["heldout_sentences"])
            write_pickle(rows_file, {"rows": rows, "heldout_rows": all_rows, "heldout": heldout})
        runs.append(
            {
                "fields": v2.sts_fields(method, arm, seed, choice[0], choice[1], corruption.key),
                "trains_rtd": v2.trains_rtd(arm),
                "config": cfg.model_dump(mode="json"),
                "rows": rows_file.name,
            }
        )
        v2.log(f"exported {method}/{arm_name}/seed {seed} (corruption {corruption.key})")
    write_pickle(dest / "sts.pkl.xz", load_sts_input(bench.sts.key, bench.root).table)
    export_backbone(Path(resolve_model_path(v2.PROTOCOL_V2["backbone"])), dest / "backbone")
    index = {"protocol": v2.protocol_hash(), "generator": generator, "runs": runs, "command": command}
    (dest / "runs.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def write_pickle(path: Path, obj: Any) -> None:
    from cse.storage.atomic import atomic_file

    with atomic_file(path) as tmp, lzma.open(tmp, "wb", preset=6) as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_pickle(path: Path) -> Any:
    with lzma.open(path, "rb") as f:
        return pickle.load(f)  # our own export, written by `export` above


def device_label(device) -> str:
    import torch

    return f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def run(
    src: Path, home: Path, part: str, device_name: str, methods, seeds, steps: int | None, command: str = ""
) -> int:
    """Train the exported runs not yet in a part of `home` on `device_name` (see the module's text)."""
    import torch

    from cse.config.training import TrainConfig
    from cse.evaluation.evaluator import Evaluator

    index = json.loads((src / "runs.json").read_text())
    if index["protocol"] != v2.protocol_hash():
        raise SystemExit(f"{src} was exported under protocol {index['protocol']}, not {v2.protocol_hash()}")
    device = torch.device(device_name)
    label = device_label(device)
    backbone = restore_backbone(src / "backbone")
    dev = functools.partial(stsb_dev, Evaluator(read_pickle(src / "sts.pkl.xz")))
    saved = v2.parts(home).load(part)
    saved["generator"] = index["generator"]
    made_by = [index["command"]] if index.get("command") else []
    saved["commands"] = list(dict.fromkeys([*made_by, *saved.get("commands", []), command]))
    saved["environment"] = {
        "device": label,
        "torch": torch.__version__,
        "float32_matmul": torch.get_float32_matmul_precision(),
    }
    for entry in index["runs"]:
        f = entry["fields"]
        if (methods and f["method"] not in methods) or (seeds and f["seed"] not in seeds):
            continue
        done = v2.done_sts(v2.parts(home).records(), v2.device_set({"device": label}))
        if (f["method"], f["arm"], f["seed"]) in done:
            continue
        overrides = {"backbone": str(backbone), "device": device.type}
        if steps is not None:  # a rehearsal
            overrides |= {"max_steps": steps, "eval_steps": max(1, steps // 2)}
        cfg = TrainConfig.model_validate({**entry["config"], **overrides})
        data = read_pickle(src / entry["rows"])
        heldout = (data["heldout_rows"], data["heldout"]) if entry["trains_rtd"] else None
        rec = {**f, "device": label, "backbone_weights": "the packaged MiniLM's, rounded to fp16 to travel"}
        t0 = time.perf_counter()
        rec.update(v2.train_sts(cfg, data["rows"], heldout, dev, home / "state" / v2.run_name(f), device))
        rec["seconds"]["total"] = round(time.perf_counter() - t0, 1)
        v2.parts(home).write(part, saved, rec)
    v2.log("done")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    e = sub.add_parser("export", help="write what the runs need into --dest")
    e.add_argument("--home", type=Path, required=True, help="evidence_v2's --home: its data root and power checks")
    e.add_argument("--dest", type=Path, required=True)
    r = sub.add_parser("run", help="train the exported runs on --device")
    r.add_argument("--src", type=Path, required=True, help="an export's folder")
    r.add_argument("--home", type=Path, required=True, help="where the parts and resume states go")
    r.add_argument("--part", default="gpu")
    r.add_argument("--device", default="cuda")
    r.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    r.add_argument("--steps", type=int, default=None, help="a rehearsal of N steps (refused by the merge)")
    for q in (e, r):
        q.add_argument("--methods", default=",".join(v2.ARMS))
        q.add_argument("--seeds", default=None)
    args = p.parse_args(argv)
    methods = parse_methods(p, args.methods, v2.ARMS)
    seeds = parse_seeds(args.seeds)
    home = args.home.resolve()
    command = command_line("benchmarks.evidence_device", argv)
    if args.verb == "export":
        use_home(home)  # evidence_v2's data root
        index = export(home, args.dest.resolve(), methods, seeds, command)
        print(f"{args.dest}: {len(index['runs'])} runs")
        return 0
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return run(args.src.resolve(), home, args.part, args.device, methods, seeds, args.steps, command)


if __name__ == "__main__":
    sys.exit(main())
