"""D2CSE training-step time versus the bare forward+backward of the same frozen encoder on the same batches.

    python -m benchmarks.training_throughput [--backbone packaged:minilm|bert-base|PATH] [--batch-size 64]
        [--steps 10] [--warmup 2] [--prefix-len 16] [--device auto] [--precision auto] [--seq-len-from-wiki PATH]

Data: real Wiki1M sentences (tokenised, max_length 32), corrupted offline by replacing 30% of the
non-special tokens with random ids (the real pipeline precomputes corruption, so it is not part of a
step); batches are built by `cse.training.rows.TrainingRows.batch` in a random epoch order.

D2CSE step: `cse.training.loop.Trainer.train_step` itself (autocast, forward, zero_grad, backward,
clip_grad_norm_ 1.0, AdamW step, LR scheduler step). The model runs the prompted encoder on the 2B view
rows (two dropout views) and the prompted, h-conditioned discriminator on the 2B corrupted rows.

Bare step: a separate copy of the same HF encoder, frozen, no prompts, no pooler, train mode (dropout on),
same autocast, forward on the 2B view rows and on the 2B corrupted rows, a trivial trainable Linear(d, 2)
head with a loss on CLS states and per-token states, then backward. The embedding-layer output is made a
leaf requiring grad, so the backward runs through every layer computing activation gradients (no weight
gradients) — what prompt tuning's backward does, where every layer's prefix K/V needs a gradient.

The two steps alternate on each batch; CUDA is synchronised around every timing. ratio =
median D2CSE step / median bare step (target <= 1.10); `paired_ratio_median` (median over batches of
D2CSE/bare on the same batch) is less sensitive to drift on noisy CPUs. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.machine import SHARED_DATA, quiet_trainer, subject_method, timed
from cse.models.loading import PACKAGED_MINILM, load_encoder, load_tokenizer, pick_device
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.loop import LoopConfig
from cse.training.rows import TrainingRows, epoch_order

TARGET = 1.10
WIKI1M_SENTENCES, PAPER_BATCH, EPOCHS = 1_000_000, 144, 2


def build_backbone(name: str) -> tuple[nn.Module, object]:
    """(encoder, tokenizer); `bert-base` is a random-init BertConfig() model with the bert-base-uncased vocab."""
    if name == "bert-base":
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        return BertModel(BertConfig(), add_pooling_layer=False), load_tokenizer(PACKAGED_MINILM)
    return load_encoder(name), load_tokenizer(name)


def training_rows(tokenizer, path: Path, n: int, mask_ratio: float = 0.3, seed: int = 0) -> TrainingRows:
    """Unsupervised TrainingRows over the first `n` sentences, with one precomputed random corruption."""
    lines = [s for s in path.read_text(encoding="utf-8").splitlines() if s.strip()][:n]
    seqs = [np.asarray(s, np.int64) for s in tokenizer(lines, truncation=True, max_length=32)["input_ids"]]
    special = np.asarray(sorted(tokenizer.all_special_ids))
    rng = np.random.default_rng(seed)
    corrupted, labels = [], []
    for s in seqs:
        pick = (rng.random(len(s)) < mask_ratio) & ~np.isin(s, special)
        c = np.where(pick, rng.integers(0, len(tokenizer), len(s)), s)
        corrupted.append(c), labels.append((c != s).astype(np.int8))
    tokens = TokenRows(ids=np.arange(len(seqs)), seqs={"text": seqs})
    corruption = CorruptionRows(variants=1, corrupted={("text", 0): corrupted}, labels={("text", 0): labels})
    return TrainingRows(tokens, corruption, supervised=False, pad_id=tokenizer.pad_token_id)


class BareStep:
    """Frozen encoder, no prompts: forward on view rows + corrupted rows, trivial head, backward."""

    def __init__(self, encoder: nn.Module, autocast):
        self.encoder = encoder.requires_grad_(False)
        self.head = nn.Linear(encoder.config.hidden_size, 2).to(encoder.device)
        self.autocast = autocast
        # The embedding output becomes a grad-requiring leaf: backward then traverses all layers.
        encoder.embeddings.register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True))

    def __call__(self, batch) -> float:
        self.encoder.train()
        rows = batch.input_ids.shape[0] * batch.input_ids.shape[1]
        ids, mask = batch.input_ids.reshape(rows, -1), batch.attention_mask.reshape(rows, -1)
        cor, lab = batch.corrupted_ids.reshape(rows, -1), batch.rtd_labels.reshape(rows, -1)
        with self.autocast():
            cls = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
            tok = self.encoder(input_ids=cor, attention_mask=mask).last_hidden_state
            loss = self.head(cls).float().logsumexp(-1).mean() + F.cross_entropy(
                self.head(tok).reshape(-1, 2).float(), lab.reshape(-1).long()
            )
        self.head.zero_grad(set_to_none=True)
        loss.backward()
        return float(loss.detach())


BASELINE = (  # what the bare step does, stated in every result
    "same HF encoder, frozen, no prompts/pooler, train mode, same autocast and batches: forward on "
    "the 2B view rows + forward on the 2B corrupted rows, trivial trainable Linear(d,2) head "
    "(logsumexp on CLS + token cross-entropy), backward; the embedding output is a leaf that "
    "requires grad so backward runs through all layers (activation grads only), as prompt "
    "tuning's does; no optimizer step"
)
METHOD_STEP = "cse.training.loop.Trainer.train_step (autocast fwd, zero_grad, backward, clip 1.0, AdamW, LR step)"


def timed_peak(fn, device: torch.device) -> tuple[float, float | None]:
    """(seconds, peak GPU GiB or None) of one call, synchronised on CUDA."""
    if device.type != "cuda":
        return timed(fn), None
    torch.cuda.reset_peak_memory_stats(device)
    return timed(fn, device), torch.cuda.max_memory_allocated(device) / 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backbone", default=PACKAGED_MINILM, help="packaged:minilm, bert-base (random init) or a model folder"
    )
    p.add_argument("--batch-size", type=int, default=64, help="sentences per step (each gives 2 views)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=16)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--seq-len-from-wiki", dest="wiki", type=Path, default=SHARED_DATA / "wiki1m_head.txt")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 2:
        p.error("--steps must be >= 1 and --batch-size >= 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = pick_device(args.device)
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    backbone, tokenizer = build_backbone(args.backbone)
    bare_encoder = copy.deepcopy(backbone)
    bare_encoder.pooler = None  # D2CSE never runs the pooler either
    torch.manual_seed(0)
    spec = subject_method("training_throughput")
    config = spec.model_config(args.backbone, {"prefix_len": args.prefix_len})
    model = spec.build_model(config, backbone, tokenizer).to(device)

    n_steps = args.warmup + args.steps
    rows = training_rows(tokenizer, args.wiki, n_steps * args.batch_size)
    order = np.resize(epoch_order(len(rows), 0, 0), n_steps * args.batch_size)
    batches = [rows.batch(order[i * args.batch_size : (i + 1) * args.batch_size], 0).to(device) for i in range(n_steps)]

    cfg = LoopConfig(
        batch_size=args.batch_size,
        learning_rate=0.021,
        epochs=1,
        max_steps=None,
        grad_clip=1.0,
        seed=0,
        eval_steps=10**9,
        checkpoint_steps=10**9,
        log_steps=10**9,
        precision=precision,
        deterministic=False,
    )
    trainer = quiet_trainer(model, rows, cfg, device, Path(tempfile.gettempdir()) / "unused-benchmark-state")
    bare = BareStep(bare_encoder.to(device), trainer.autocast)

    t_d2cse, t_bare, mem_d2cse, mem_bare = [], [], [], []
    for i, batch in enumerate(batches):  # alternate, so drift (thermal, allocator) hits both alike
        tb, mb = timed_peak(lambda b=batch: bare(b), device)
        td, md = timed_peak(lambda b=batch: trainer.train_step(b), device)
        if i >= args.warmup:
            t_bare.append(tb), t_d2cse.append(td), mem_bare.append(mb), mem_d2cse.append(md)
    result = report(args, model, device, precision, batches[args.warmup :], t_d2cse, t_bare)
    if device.type == "cuda":
        result["peak_gpu_memory_gib"] = {spec.name: max(mem_d2cse), "bare": max(mem_bare)}
        result["goal_minutes_h100"] = 15
    print(json.dumps(result, indent=2))
    return result


def report(args, model, device: torch.device, precision: str, timed_batches, t_d2cse, t_bare) -> dict:
    """The result: median step times of the method and the bare baseline, their ratio against the target, the
    throughputs, and the Wiki1M projection.

    Args:
        args: the command line.
        model: the method's model.
        device: where it ran.
        precision: the precision it ran at.
        timed_batches: the batches after the warm-up.
        t_d2cse: the method's step seconds on them.
        t_bare: the baseline's.
    """
    views = sum(b.sentences for b in timed_batches) / args.steps  # 2B view sentences per step
    tokens = sum(b.tokens for b in timed_batches) / args.steps
    step_d, step_b = statistics.median(t_d2cse), statistics.median(t_bare)
    ratio = step_d / step_b
    # Wiki1M in steps of B_paper = 144 sentences; the measured throughput is scaled to that batch
    # (exactly the paper-batch formula (1e6 / 144) * 2 * step_time / 60 when --batch-size 144).
    step_at_paper_batch = step_d * PAPER_BATCH / args.batch_size
    projected = WIKI1M_SENTENCES / PAPER_BATCH * EPOCHS * step_at_paper_batch / 60
    result = {
        "benchmark": "training_throughput",
        "backbone": args.backbone,
        "backbone_size": {"layers": model.encoder.num_layers, "hidden": model.hidden_size},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "torch_threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "view_sentences_per_step": views,
        "mean_tokens_per_step": tokens,
        "mean_padded_length": statistics.mean(b.input_ids.shape[-1] for b in timed_batches),
        "prefix_len": args.prefix_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "d2cse_step_s": step_d,
        "bare_step_s": step_b,
        "d2cse_step_s_all": [round(t, 4) for t in t_d2cse],
        "bare_step_s_all": [round(t, 4) for t in t_bare],
        "d2cse_sentences_per_s": views / step_d,
        "bare_sentences_per_s": views / step_b,
        "d2cse_tokens_per_s": tokens / step_d,
        "bare_tokens_per_s": tokens / step_b,
        "ratio": ratio,
        "paired_ratio_median": statistics.median(d / b for d, b in zip(t_d2cse, t_bare)),
        "target": TARGET,
        "meets_target": ratio <= TARGET,
        "baseline": BASELINE,
        "d2cse_step": METHOD_STEP,
    }
    result["projected_wiki1m_2_epochs_minutes" + ("" if device.type == "cuda" else "_cpu_info_only")] = projected
    result["projection"] = (
        f"(1e6 / {PAPER_BATCH}) * {EPOCHS} * step_time_at_batch_{PAPER_BATCH} / 60, step time scaled "
        f"linearly from batch {args.batch_size}"
        + ("" if args.batch_size == PAPER_BATCH else " (run --batch-size 144 for the exact figure)")
    )
    return result


if __name__ == "__main__":
    main()
