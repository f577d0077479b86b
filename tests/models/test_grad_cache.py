"""Exact gradient caching (models/grad_cache.py): for every method and phase, a step whose per-row passes run in
cached chunks gives the gradients of the same step with the chunks' graphs kept, within 1e-5 relative, with dropout,
prefix dropout and MLM masking on; three optimiser steps end with the same parameters. Without replaying each
chunk's random state the gradients differ (so these tests can fail). With nothing random, the cached step equals the
one-pass step on the whole batch (float64: the BatchNorm MLP amplifies the rounding of different matmul shapes).
The two-rank case is in tests/ops/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from cse.models.batching import TrainBatch
from cse.models.grad_cache import RowChunks
from tests.batches import default_dtype
from tests.tolerance import assert_close_scaled

CHUNK = 3  # 16 or 24 rows per batch: five or eight chunks, the last one short
SENTENCES = [
    "a man is playing a guitar on the stage .",
    "the cat sleeps",
    "two dogs run on the beach today",
    "it rains",
    "a woman slices an onion in the kitchen",
    "kids play football",
    "the sun is shining brightly over the hills",
    "rain",
]
ENTAILED = ["a person plays music", "an animal rests", "dogs are outside", "it is wet"] * 2
CONTRADICTED = ["nobody plays", "the cat runs", "no dogs", "it is dry and sunny"] * 2


def _rows(tokenizer, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=16, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _unsup(tokenizer, corrupt: bool = False) -> TrainBatch:
    ids, mask = _rows(tokenizer, SENTENCES)
    batch = TrainBatch(ids.unsqueeze(1).repeat(1, 2, 1), mask.unsqueeze(1).repeat(1, 2, 1))
    return _with_corruption(batch) if corrupt else batch


def _sup(tokenizer, corrupt: bool = False) -> TrainBatch:
    ids, mask = _rows(tokenizer, SENTENCES + ENTAILED + CONTRADICTED)
    b = len(SENTENCES)
    batch = TrainBatch(
        ids.view(3, b, -1).transpose(0, 1).contiguous(), mask.view(3, b, -1).transpose(0, 1).contiguous()
    )
    return _with_corruption(batch) if corrupt else batch


def _with_corruption(batch: TrainBatch) -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    ids, mask = batch.input_ids, batch.attention_mask
    pick = (torch.rand(ids.shape, generator=g) < 0.3) & (mask == 1)
    pick[..., 0] = False
    corrupted = torch.where(pick, torch.randint(2000, 3000, ids.shape, generator=g), ids)
    return TrainBatch(ids, mask, corrupted, None)


def _semi(tokenizer) -> TrainBatch:
    batch = _unsup(tokenizer)
    batch.aux = _sup(tokenizer)
    return batch


def _build(kind: str, path: str, tokenizer, dropout: float):
    """A method on the tiny BERT of the session (dropout `dropout` everywhere, prefix dropout too)."""
    from cse.models.loading import load_encoder

    torch.manual_seed(0)
    backbone = load_encoder(path)
    from cse.models.method import set_backbone_dropout

    set_backbone_dropout(backbone, dropout)
    prompt = dict(prefix_len=4, prefix_dropout=dropout)
    if kind.startswith("simcse"):
        from cse.models.methods.simcse import SimCSE, SimCSEConfig

        return SimCSE(SimCSEConfig(backbone=path, hard_negative_weight=0.7), backbone, tokenizer)
    if kind.startswith("dcpcse"):
        from cse.models.methods.dcpcse import DCPCSE, DCPCSEConfig

        mlm = dict(mlm=True, mlm_head_random_init=True, mlm_probability=0.3) if kind == "dcpcse_mlm" else {}
        return DCPCSE(DCPCSEConfig(backbone=path, **prompt, **mlm), backbone, tokenizer)
    if kind.startswith("d2cse"):
        from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig

        extra = {
            "d2cse": dict(cls_prompt=True),
            "d2cse_trainable_discriminator": D2CSE.ablations["b"],
            "d2cse_unconditioned": D2CSE.ablations["c"],
        }[kind]
        return D2CSE(D2CSEModelConfig(backbone=path, rtd_weight=0.5, **prompt, **extra), backbone, tokenizer)
    if kind.startswith("diffcse"):
        from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig

        return DiffCSE(
            DiffCSEConfig(backbone=path, rtd_weight=0.5, hard_negative_weight=0.3, rtd_mean_over_padding=False),
            backbone,
            tokenizer,
        )
    if kind.startswith("diffaug"):
        from cse.models.methods.diffaug import DiffAug, DiffAugConfig

        cfg = DiffAugConfig(
            backbone=path, prefix_dropout=dropout, max_sentence_tokens=14, denoise_copies=24, aux_weight=0.5
        )
        return DiffAug(cfg, backbone, tokenizer)
    raise ValueError(kind)


# name → (model kind, batch maker, phase): every method, every phase, with and without hard negatives, the MLM
# auxiliary, the CRTD loss (conditioned, unconditioned, trainable discriminator), DiffAug's auxiliary NLI rows
CASES = {
    "simcse_unsup": ("simcse", _unsup, "main"),
    "simcse_sup_hard_negatives": ("simcse", _sup, "main"),
    "dcpcse": ("dcpcse", _unsup, "main"),
    "dcpcse_mlm_auxiliary": ("dcpcse_mlm", _unsup, "main"),
    "dcpcse_sup_hard_negatives": ("dcpcse", _sup, "main"),
    "d2cse_crtd_cls_prompt": ("d2cse", lambda t: _unsup(t, corrupt=True), "main"),
    "d2cse_ablation_b_trainable_discriminator": (
        "d2cse_trainable_discriminator",
        lambda t: _unsup(t, corrupt=True),
        "main",
    ),
    "d2cse_ablation_c_unconditioned": ("d2cse_unconditioned", lambda t: _unsup(t, corrupt=True), "main"),
    "diffcse_unsup": ("diffcse", lambda t: _unsup(t, corrupt=True), "main"),
    "diffcse_sup_hard_negatives": ("diffcse", lambda t: _sup(t, corrupt=True), "main"),
    "diffaug_prefix_phase": ("diffaug", _sup, "prefix"),
    "diffaug_joint_with_aux_nli": ("diffaug", _semi, "joint"),
}


def _grads(model, batch: TrainBatch, phase: str, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    torch.manual_seed(seed)
    out = model.training_step(batch, step=0, phase=phase)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.item(), grads


def _step(case: str, path: str, tokenizer, chunks: RowChunks, dropout: float = 0.1, seed: int = 3):
    kind, make, phase = CASES[case]
    model = _build(kind, path, tokenizer, dropout).to(torch.get_default_dtype())
    model.use_grad_cache(chunks)
    return _grads(model, make(tokenizer), phase, seed)


def _assert_same_grads(got: dict, want: dict, what: str, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys(), what
    for n, g in want.items():
        scale = g.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(
            got[n], g, rtol=rtol, atol=rtol * float(scale), msg=lambda m, n=n: f"{what}, {n}: {m}"
        )


@pytest.mark.parametrize("case", list(CASES))
def test_cached_chunks_give_the_gradients_of_the_same_chunks_with_their_graphs(case, tiny_bert_dir, tokenizer):
    path = str(tiny_bert_dir)
    loss_ref, ref = _step(case, path, tokenizer, RowChunks(CHUNK, keep_graph=True))
    loss, got = _step(case, path, tokenizer, RowChunks(CHUNK))
    assert ref and any(g.abs().sum() > 0 for g in ref.values())
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    _assert_same_grads(got, ref, case)


@pytest.mark.parametrize("case", ["simcse_sup_hard_negatives", "d2cse_crtd_cls_prompt", "diffaug_joint_with_aux_nli"])
def test_without_randomness_the_cached_step_equals_the_one_pass_step(case, tiny_bert_dir, tokenizer):
    path = str(tiny_bert_dir)
    with default_dtype(torch.float64):
        _, whole = _step(case, path, tokenizer, RowChunks(None), dropout=0.0)
        _, cached = _step(case, path, tokenizer, RowChunks(CHUNK), dropout=0.0)
    _assert_same_grads(cached, whole, case, rtol=1e-6)  # (the losses compute their logits in float32)


def test_without_replaying_the_random_state_the_gradients_differ(tiny_bert_dir, tokenizer):
    path = str(tiny_bert_dir)
    _, ref = _step("simcse_unsup", path, tokenizer, RowChunks(CHUNK, keep_graph=True))
    _, replayed = _step("simcse_unsup", path, tokenizer, RowChunks(CHUNK))
    _, unreplayed = _step("simcse_unsup", path, tokenizer, RowChunks(CHUNK, replay_random_state=False))
    _assert_same_grads(replayed, ref, "replayed")
    worst = max(float((unreplayed[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref.items())
    assert worst > 1e-2  # the re-encoded chunks drew other dropout masks than the cached vectors


def test_bf16_autocast_is_replayed_in_the_recomputation(tiny_bert_dir, tokenizer):
    path = str(tiny_bert_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ref = _step("d2cse_crtd_cls_prompt", path, tokenizer, RowChunks(CHUNK, keep_graph=True))
        _, got = _step("d2cse_crtd_cls_prompt", path, tokenizer, RowChunks(CHUNK))
    _assert_same_grads(got, ref, "bf16")


def _train_three_steps(case: str, path: str, tokenizer, chunks: RowChunks) -> dict[str, torch.Tensor]:
    """Three AdamW steps with clipping, as the trainer takes them, on three batches (the same batch, new dropout)."""
    kind, make, phase = CASES[case]
    model = _build(kind, path, tokenizer, 0.1).train()
    model.use_grad_cache(chunks)
    optimizer = torch.optim.AdamW(model.parameter_groups(phase), lr=1e-3, weight_decay=0.0)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    batch = make(tokenizer)
    torch.manual_seed(11)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        model.training_step(batch, step=step, phase=phase).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "case", ["simcse_unsup", "dcpcse_mlm_auxiliary", "d2cse_crtd_cls_prompt", "diffcse_unsup", "diffaug_prefix_phase"]
)
def test_three_steps_end_with_the_same_parameters(case, tiny_bert_dir, tokenizer):
    path = str(tiny_bert_dir)
    ref = _train_three_steps(case, path, tokenizer, RowChunks(CHUNK, keep_graph=True))
    got = _train_three_steps(case, path, tokenizer, RowChunks(CHUNK))
    before = {n: p.detach() for n, p in _build(CASES[case][0], path, tokenizer, 0.1).named_parameters()}
    assert any(not torch.equal(before[n], p) for n, p in ref.items())  # the steps moved something
    for n, p in ref.items():
        assert_close_scaled(got[n], p, terms=64, rtol=1e-5, msg=lambda m, n=n: f"{case}, {n}: {m}")


def test_a_chunk_size_of_the_whole_batch_runs_the_one_pass_step(tiny_bert_dir, tokenizer):
    path = str(tiny_bert_dir)
    loss_whole, whole = _step("dcpcse_mlm_auxiliary", path, tokenizer, RowChunks(None))
    loss_big, big = _step("dcpcse_mlm_auxiliary", path, tokenizer, RowChunks(1000))
    assert loss_big == loss_whole
    for n, g in whole.items():
        assert torch.equal(big[n], g), n


def test_configurations_that_cannot_be_cached_are_refused_with_the_reason(tiny_bert_dir, tokenizer):
    from cse.config.training import TrainConfig

    model = _build("d2cse", str(tiny_bert_dir), tokenizer, 0.1)
    from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig

    reuse = D2CSEModelConfig(backbone="x", discriminator_reuses_prefix_sample=True)
    assert "prefix sample" in D2CSE.grad_cache_refusal(reuse)
    assert D2CSE.grad_cache_refusal(model.config) is None
    with pytest.raises(ValueError, match="grad_cache.chunk_size: d2cse cannot cache gradients exactly here"):
        TrainConfig(method="d2cse", model={"discriminator_reuses_prefix_sample": True}, grad_cache={"chunk_size": 32})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        TrainConfig(method="simcse", grad_cache={"chunk_size": 0})
    with pytest.raises(ValueError, match="positive number of rows"):
        RowChunks(0)
    assert TrainConfig(method="simcse", grad_cache={"chunk_size": 32}).grad_cache.chunk_size == 32
