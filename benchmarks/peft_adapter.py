"""PEFT prefix adapter versus the sentence-transformers export: size on disk and load time, MiniLM backbone.

    python -m benchmarks.peft_adapter [--backbone packaged:minilm] [--prefix-len 16] [--cls-prompt] [--repeat 5]
                                      [--checkpoint DIR] [--out results.json]

A D2CSE checkpoint (fresh prompts unless `--checkpoint` names a trained one; sizes and load times do not depend on
training) is exported both ways: `cse.models.export.st_export.export_sentence_transformer` (our module inside a
sentence-transformers folder; loading needs this package) and `cse.models.export.peft_export.export_peft_adapter` (standard PEFT
files; loading needs transformers + peft only). Both reference the backbone by name, so the bytes of the backbone's
own weights are printed beside them for scale.

Load time, median of `--repeat` interleaved rounds, each load in a fresh Python process (disk cache warm, so
in-process caches such as our tokenizer cache do not flatter either side); `import` is the imports a loader needs,
`load` the load call after them:
- st: `SentenceTransformer(folder, trust_remote_code=True)` (imports sentence-transformers and this package; loads
  backbone + tokenizer + checkpoint);
- peft: `load_prefix_encoder(folder)` of the folder's own `peft_embed.py` (imports transformers + peft only;
  `AutoModel.from_pretrained(base)` + `PeftModel.from_pretrained` + `AutoTokenizer`);
- peft_attach (in this process): `PeftModel.from_pretrained` alone on a loaded base, the adapter's own cost.
Also printed: the largest difference between the two exports' embeddings of 32 STS-B test sentences. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from benchmarks.machine import REPO_ROOT, subject_method, timed
from cse.models.checkpoint import save_checkpoint
from cse.models.export import peft_loader
from cse.models.export.peft_export import export_peft_adapter
from cse.models.export.st_export import CHECKPOINT_SUBDIR, export_sentence_transformer
from cse.models.loading import resolve_model_path
from cse.storage.readers import read_senteval
from cse.storage.settings import get_settings


def folder_bytes(folder: Path, exclude: str | None = None) -> int:
    return sum(
        p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and (exclude is None or exclude not in p.relative_to(folder).parts)
    )


_ST_LOAD = """
import json, sys, time
t = time.perf_counter()
from sentence_transformers import SentenceTransformer
import cse.models.export.st_export
i = time.perf_counter() - t
t = time.perf_counter()
SentenceTransformer(sys.argv[1], trust_remote_code=True, device="cpu")
print(json.dumps({"import": i, "load": time.perf_counter() - t}))
"""
_PEFT_LOAD = """
import importlib.util, json, sys, time
from pathlib import Path
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("peft_embed", Path(sys.argv[1]) / "peft_embed.py")
peft_embed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peft_embed)
i = time.perf_counter() - t
t = time.perf_counter()
peft_embed.load_prefix_encoder(sys.argv[1])
print(json.dumps({"import": i, "load": time.perf_counter() - t}))
"""


def fresh_process_load(script: str, folder: Path, cwd: Path) -> dict[str, float]:
    """Run one load in a new interpreter; returns its import and load seconds."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_rounds(st_dir: Path, peft_folder: Path, base_path: str, work: Path, repeat: int) -> dict[str, list[float]]:
    """Seconds of each way of loading the exported model, `repeat` times after one round that warms the disk cache:
    the ST folder and the PEFT folder's loader (import and load, each in a fresh interpreter), and the PEFT adapter
    attached to its base model in this process."""
    from peft import PeftModel
    from transformers import AutoModel

    rounds: dict[str, list[float]] = {
        k: [] for k in ("st_import", "st_load", "peft_import", "peft_load", "peft_attach")
    }
    for i in range(repeat + 1):
        st_s = fresh_process_load(_ST_LOAD, st_dir, cwd=REPO_ROOT)  # our package must be importable for the ST folder
        peft_s = fresh_process_load(_PEFT_LOAD, peft_folder, cwd=work)  # outside the repository
        base = AutoModel.from_pretrained(base_path)
        attach_s = timed(lambda base=base: PeftModel.from_pretrained(base, str(peft_folder)))
        if i:  # the first round warms the disk cache
            for side, seconds in (("st", st_s), ("peft", peft_s)):
                rounds[f"{side}_import"].append(seconds["import"])
                rounds[f"{side}_load"].append(seconds["load"])
            rounds["peft_attach"].append(attach_s)
    return rounds


def st_vs_peft(st_dir: Path, peft_folder: Path, senteval_arg: str | None) -> tuple[list[str], float]:
    """The first 32 STS-B test sentences and the largest absolute difference between their embeddings by the ST
    folder and by the PEFT folder's loader."""
    from sentence_transformers import SentenceTransformer

    senteval = Path(senteval_arg) if senteval_arg else get_settings().shared_data / "senteval"
    table, _ = read_senteval(senteval)
    df = table.to_pandas()
    sentences = list(df[(df.task == "stsb") & (df.split == "test")].sentence1[:32])
    st = SentenceTransformer(str(st_dir), trust_remote_code=True, device="cpu")
    model, tokenizer, spec = peft_loader.load_prefix_encoder(peft_folder)
    peft_embeddings = peft_loader.embed_sentences(model, tokenizer, spec, sentences)
    return sentences, float((st.encode(sentences, convert_to_tensor=True).float() - peft_embeddings).abs().max())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="packaged:minilm")
    p.add_argument("--prefix-len", type=int, default=16)
    p.add_argument(
        "--cls-prompt", action="store_true", help="also train a [CLS] prompt (carried in the position table)"
    )
    p.add_argument(
        "--checkpoint", default=None, help="a trained D2CSE/DCPCSE/DiffAug checkpoint instead of fresh prompts"
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--senteval", default=None, help="SentEval folder (default: $CSE_SHARED_DATA/senteval)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    work = Path(tempfile.mkdtemp(prefix="peft-bench-"))
    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
    else:
        torch.manual_seed(0)
        spec = subject_method("peft_adapter")
        model = spec.build_model(
            spec.model_config(args.backbone, {"prefix_len": args.prefix_len, "cls_prompt": args.cls_prompt})
        )
        checkpoint = save_checkpoint(model.eval(), work / "checkpoint")
    st_dir = export_sentence_transformer(checkpoint, work / "st")
    t0 = time.perf_counter()
    export = export_peft_adapter(checkpoint, work / "adapter")
    export_seconds = time.perf_counter() - t0
    base_path = peft_loader.base_model_path(export.folder)
    base_weights = sum(f.stat().st_size for f in Path(resolve_model_path(base_path)).glob("*.safetensors"))

    rounds = load_rounds(st_dir, export.folder, base_path, work, args.repeat)
    sentences, diff = st_vs_peft(st_dir, export.folder, args.senteval)

    result = {
        "backbone": args.backbone,
        "method": export.method,
        "prefix_len": json.loads((export.folder / "adapter_config.json").read_text())["num_virtual_tokens"],
        "modules_to_save": export.modules_to_save,
        "exact": export.exact,
        "bytes": {
            "peft_adapter_files": export.adapter_bytes,
            "peft_folder": export.folder_bytes,
            "st_folder": folder_bytes(st_dir),
            "st_checkpoint": folder_bytes(st_dir / CHECKPOINT_SUBDIR),
            "backbone_weights": base_weights,
        },
        "load_seconds_median": {k: round(statistics.median(v), 4) for k, v in rounds.items()},
        "load_seconds_all": {k: [round(x, 4) for x in v] for k, v in rounds.items()},
        "export_seconds": round(export_seconds, 3),
        "st_vs_peft_max_abs_diff": diff,
        "sentences_compared": len(sentences),
        "torch_threads": torch.get_num_threads(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
