"""Why do prompt methods start below their frozen encoder? STS-B dev at step 0 of D2CSE's smoke model (MiniLM, P = 8).

    python -m benchmarks.prompt_start [--seed 0] [--threads 1]

Scores the untrained D2CSE model (the prompts as initialised under the seed), the same model with every prompt value
set to zero, the model whose prompts start as the backbone's own [SEP] key/value (`model.prefix_init: sep`), each
with and without the position shift (`model.shift_positions`), and the plain MiniLM's CLS state.
Prints one line per model; reads the local data mirror (`../shared/data`), nothing is trained.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.machine import set_offline_environment, sts_evaluator, subject_method

set_offline_environment()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("CSE_HOME", tempfile.mkdtemp(prefix="cse-prompt-start-"))
    import torch

    from cse.config.training import resolve_train_config
    from cse.models.embedder import PooledEncoder
    from cse.models.loading import PACKAGED_MINILM, load_tokenizer
    from cse.training.job import build_model
    from cse.training.loop import set_seed

    if args.threads:
        torch.set_num_threads(args.threads)
    evaluator = sts_evaluator()

    def dev(model) -> float:
        return round(float(evaluator.run(model, mode="dev", batch_size=128).metrics()["stsb_dev"]), 2)

    model = None
    for shift in (True, False):
        cfg = resolve_train_config(
            "smoke",
            {"seed": args.seed, "model": {"shift_positions": shift}},
            method=subject_method("prompt_start").name,
        )
        set_seed(cfg.seed)
        model = build_model(cfg, torch.device("cpu")).eval()
        print(f"D2CSE step 0, prompts as initialised, shift_positions={shift}: {dev(model):.2f}", flush=True)
        with torch.no_grad():
            for param in model.encoder.prefix_encoder.parameters():
                param.zero_()
        print(f"D2CSE step 0, every prompt value 0,     shift_positions={shift}: {dev(model):.2f}", flush=True)
        sep = resolve_train_config(
            "smoke",
            {"seed": args.seed, "model": {"shift_positions": shift, "prefix_init": "sep"}},
            method=subject_method("prompt_start").name,
        )
        set_seed(sep.seed)
        print(
            f"D2CSE step 0, prefix_init sep,          shift_positions={shift}: "
            f"{dev(build_model(sep, torch.device('cpu')).eval()):.2f}",
            flush=True,
        )
    plain = PooledEncoder(
        model.backbone, "cls_before_pooler", tokenizer=load_tokenizer(PACKAGED_MINILM), name="MiniLM CLS"
    )
    print(f"MiniLM CLS state, no prompts: {dev(plain):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
