"""Evaluator throughput versus the bare encoder forward, and the wall time of a full evaluation.

    python -m benchmarks.evaluation_throughput [--model packaged:minilm] [--pooler avg] [--mode test]

Bare forward: the backbone alone over the same unique sentences, in the same length-sorted, already
padded batches, under `torch.inference_mode` (tokenisation and padding not timed). Evaluator: the
wall time of `Evaluator.run` (tokenisation, embedding, pooling, every metric). ratio = evaluator
sentences/s ÷ bare sentences/s (target ≥ 0.9). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from benchmarks.machine import timed
from cse.evaluation import Evaluator
from cse.evaluation.encode import autocast_context, length_sorted_batches, pad_batch
from cse.models.embedder import PooledEncoder
from cse.models.loading import pick_device
from cse.storage.readers import read_senteval
from cse.storage.settings import get_settings


def bare_forward_seconds(enc: PooledEncoder, token_ids, batch_size: int, precision: str) -> float:
    device = enc.device
    batches = [
        pad_batch([token_ids[i] for i in idx], enc.pad_token_id)
        for idx in length_sorted_batches([len(x) for x in token_ids], batch_size)
    ]
    batches = [(a.to(device), m.to(device)) for a, m in batches]

    @torch.inference_mode()
    def forward_all() -> None:
        with autocast_context(device, precision):
            for ids, mask in batches:
                enc.backbone(input_ids=ids, attention_mask=mask)

    return timed(forward_all, device)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="packaged:minilm")
    p.add_argument("--pooler", default="avg")
    p.add_argument("--mode", default="test", choices=["test", "dev"])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the fastest of each is reported")
    p.add_argument("--senteval", default=None, help="SentEval folder (default: $CSE_SHARED_DATA/senteval)")
    args = p.parse_args(argv)

    folder = Path(args.senteval) if args.senteval else get_settings().shared_data / "senteval"
    table, _ = read_senteval(folder)
    device = pick_device(args.device)
    enc = PooledEncoder.from_pretrained(args.model, args.pooler, device=device)
    evaluator = Evaluator(table)
    sentences = evaluator.sentences(args.mode)
    token_ids = enc.token_ids(sentences)
    bare_forward_seconds(enc, token_ids[:256], args.batch_size, args.precision)  # warm-up
    load_before = os.getloadavg()
    bare, wall, embed_s, result = [], [], [], None
    for _ in range(args.repeat):
        bare.append(bare_forward_seconds(enc, token_ids, args.batch_size, args.precision))
        fresh = Evaluator(table)  # no token cache: the wall time includes tokenisation
        t0 = time.perf_counter()
        result = fresh.run(enc, args.mode, batch_size=args.batch_size, precision=args.precision)
        wall.append(time.perf_counter() - t0)
        embed_s.append(result.timing.embed_seconds)
    n = len(sentences)
    out = {
        "model": args.model,
        "pooler": args.pooler,
        "mode": args.mode,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "repeat": args.repeat,
        "unique_sentences": n,
        "tokens": sum(len(x) for x in token_ids),
        "bare_forward_s": round(min(bare), 2),
        "bare_sentences_per_s": round(n / min(bare), 1),
        "evaluator_embed_s": round(min(embed_s), 2),
        "evaluator_wall_s": round(min(wall), 2),
        "evaluator_sentences_per_s": round(n / min(wall), 1),
        "ratio": round(min(bare) / min(wall), 3),
        "target_ratio": 0.9,
        "full_evaluation_wall_s": round(min(wall), 2),
        "goal_wall_s": 60 if args.mode == "test" else None,
        "scores": result.table_record(f"{args.model} {args.pooler}"),
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
