"""Each method's defining part is wired (issue 19, part 4), on the tiny BERT of tests/conftest.py.

- D2CSE / DiffCSE: the (C)RTD loss alone sends gradient into the prompts / the encoder through the conditioning
  vector h, and none when h is detached or unused (D2CSE ablation (c)); shuffling h across the batch changes the
  discriminator's logits row by row; λ = 0 gives exactly the gradients of the contrastive-only control.
- DCPCSE / D2CSE: `train_prompts=False` keeps the prompts bit-identical through the real Trainer, and saves them.
- DiffAug: stage 1 through the real Trainer moves only the prefix (and its NLI classifier); `shared_prefix` gives
  both joint-stage views the same prefix module.
- SimCSE: `dropout=0.0` makes two train-mode passes identical (the paper's "no dropout" row); None keeps dropout.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from cse.models.batching import TrainBatch
from cse.models.checkpoint import load_checkpoint, save_checkpoint
from cse.models.export.peft_export import export_peft_adapter
from cse.models.losses import contrastive_loss
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.models.methods.dcpcse import DCPCSE, DCPCSEConfig
from cse.models.methods.diffaug import DiffAug, DiffAugConfig
from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig
from cse.models.methods.simcse import SimCSE, SimCSEConfig
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.loop import Phase, Trainer
from cse.training.rows import TrainingRows
from tests.batches import SENTENCES, corrupted_views
from tests.loops import cpu_trainer, loop_config

B, T, D = 4, 9, 32
SEED = 1234


def _d2cse(tiny_bert_dir, **overrides) -> D2CSE:
    torch.manual_seed(0)
    return D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, **overrides))


def _diffcse(tiny_bert_dir, **overrides) -> DiffCSE:
    torch.manual_seed(0)
    return DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir), **overrides))


BUILD = {"d2cse": _d2cse, "diffcse": _diffcse}


def _capture_h(model, detach: bool = False) -> list[torch.Tensor]:
    """Record (and optionally detach) the BN-MLP output h of every forward."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        out = output.detach() if detach else output
        seen.append(out)
        return out

    model.projection.register_forward_hook(hook)
    return seen


def _grads(loss: torch.Tensor, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor | None]:
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)))


def _nonzero(g: torch.Tensor | None) -> bool:
    return g is not None and bool(g.abs().sum() > 0)


# ------------------------------------------------------------------------------------------------ gradient through h
def test_d2cse_crtd_loss_reaches_the_prompts_through_h(tiny_bert_dir, tokenizer):
    ids, mask, cor, lab = corrupted_views(tokenizer, length=T)
    prompts = lambda m: dict(m.prompts.named_parameters())

    # D2CSE: the CRTD term alone, followed back through h into the encoder pass's prompts
    model = _d2cse(tiny_bert_dir).train()
    h = _capture_h(model)
    out = model(ids, mask, cor, lab)
    (dh,) = torch.autograd.grad(out.rtd_loss, h[0], retain_graph=True)
    assert dh.abs().sum() > 0
    via_h = torch.autograd.grad(h[0], list(prompts(model).values()), grad_outputs=dh)
    assert all(_nonzero(g) for g in via_h)

    # ablation (c): h is not used by the discriminator, so no CRTD gradient reaches it
    model = _d2cse(tiny_bert_dir, condition_discriminator=False).train()
    h = _capture_h(model)
    out = model(ids, mask, cor, lab)
    assert torch.autograd.grad(out.rtd_loss, h[0], allow_unused=True)[0] is None

    # ablation (a)'s discriminator has no prompts: h is the only path, so the whole CRTD gradient of the prompts is
    # nonzero with conditioning and exactly absent without it or with h detached
    model = _d2cse(tiny_bert_dir, discriminator_prompts=False).train()
    assert all(_nonzero(g) for g in _grads(model(ids, mask, cor, lab).rtd_loss, prompts(model)).values())
    for variant in ({"condition_discriminator": False}, {"detach": True}):
        model = _d2cse(
            tiny_bert_dir, discriminator_prompts=False, **{k: v for k, v in variant.items() if k != "detach"}
        ).train()
        if variant.get("detach"):
            _capture_h(model, detach=True)
        out = model(ids, mask, cor, lab)
        assert out.rtd_loss.requires_grad  # the RTD head still learns
        assert all(g is None for g in _grads(out.rtd_loss, prompts(model)).values()), variant


def test_diffcse_rtd_loss_reaches_the_encoder_only_through_h(tiny_bert_dir, tokenizer):
    ids, mask, cor, lab = corrupted_views(tokenizer, length=T)
    model = _diffcse(tiny_bert_dir).train()
    encoder = dict(model.encoder.named_parameters())
    grads = _grads(model(ids, mask, cor, lab).rtd_loss, encoder)
    reached = {n for n, g in grads.items() if _nonzero(g)}
    # every encoder tensor (the pretrained pooler is dropped)
    assert "embeddings.word_embeddings.weight" in reached and "encoder.layer.1.output.dense.weight" in reached
    assert len(reached) == len(encoder), sorted(set(encoder) - reached)

    detached = _diffcse(tiny_bert_dir).train()
    _capture_h(detached, detach=True)
    out = detached(ids, mask, cor, lab)
    assert all(g is None for g in _grads(out.rtd_loss, dict(detached.encoder.named_parameters())).values())
    assert _nonzero(_grads(out.rtd_loss, {"w": detached.rtd_head.classifier.weight})["w"])  # D and its head still learn


# ------------------------------------------------------------------------------------------------ shuffled h
@pytest.mark.parametrize("method", ["d2cse", "diffcse"])
def test_shuffling_h_changes_the_discriminator_logits_row_by_row(method, tiny_bert_dir, tokenizer):
    model = BUILD[method](tiny_bert_dir).eval()  # deterministic passes
    ids, mask, cor, _ = corrupted_views(tokenizer, length=T)
    ids, mask, cor = ids[:, 0], mask[:, 0], cor[:, 0]
    with torch.no_grad():
        h = model.projection(model.encode_cls(ids, mask))
        perm = torch.tensor([0, 2, 3, 1])  # row 0 keeps its own h
        logits = model.discriminate(cor, mask, h)
        shuffled = model.discriminate(cor, mask, h[perm])
        again = model.discriminate(cor, mask, h)
    assert torch.equal(logits, again)
    assert torch.equal(logits[0], shuffled[0])
    for row in (1, 2, 3):
        assert (logits[row] - shuffled[row]).abs().max() > 1e-4, row


# ------------------------------------------------------------------------------------------------ λ = 0 == control
def _control_grads(model, ids, mask) -> dict[str, torch.Tensor]:
    """The contrastive-only control: the method's own encoder pass and BN-MLP, the contrastive loss on h, no
    discriminator (D2CSE: prompts + BN-MLP; DiffCSE: SimCSE with DiffCSE's head)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    cls, _ = model.encode_rows(ids.reshape(-1, T), mask.reshape(-1, T), None)
    z = model.projection(cls).view(B, 2, -1)
    contrastive_loss(z[:, 0], z[:, 1], temperature=model.config.temperature).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _method_grads(model, ids, mask, cor, lab) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    model(ids, mask, cor, lab).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["d2cse", "diffcse"])
def test_zero_rtd_weight_gives_exactly_the_control_gradients(method, tiny_bert_dir, tokenizer):
    ids, mask, cor, lab = corrupted_views(tokenizer, length=T)
    model = BUILD[method](tiny_bert_dir, rtd_weight=0.0).train()
    control = _control_grads(model, ids, mask)
    assert control and any("projection" in n for n in control)
    zero = _method_grads(model, ids, mask, cor, lab)
    for name, g in zero.items():
        if name in control:
            assert torch.equal(g, control[name]), name
        else:  # the discriminator side (RTD head, DiffCSE's D) gets exactly nothing
            assert name.startswith(("rtd_head.", "discriminator.")) and not g.any(), name
    # the same weights with λ > 0: the CRTD term changes the shared gradients (the assertion above can fail)
    model.config = dataclasses.replace(model.config, rtd_weight=0.5)
    weighted = _method_grads(model, ids, mask, cor, lab)
    shared = (
        "encoder.prefix_encoder.embedding.weight" if method == "d2cse" else "encoder.embeddings.word_embeddings.weight"
    )
    assert not torch.equal(weighted[shared], control[shared])
    assert weighted["rtd_head.classifier.weight"].abs().sum() > 0


# ------------------------------------------------------------------------------------------------ frozen prompts
PREMISES = ["a man is playing a guitar on the stage .", "the cat sleeps", "two dogs run on the beach", "it rains"]
ENTAILED = ["a person plays music .", "an animal rests", "dogs are outside", "the weather is wet"]
CONTRADICTED = ["nobody is playing .", "the cat is running around the house", "no dogs", "it is sunny and dry"]


@pytest.fixture
def rows_of(tokenizer):
    """In-memory `TrainingRows` of real sentences: unsupervised (optionally with a corruption) or NLI triplets."""

    def seqs(sentences):
        return [np.asarray(x, dtype=np.int64) for x in tokenizer(sentences, truncation=True, max_length=T)["input_ids"]]

    def make(kind: str) -> TrainingRows:
        if kind == "nli":
            cols = {"sent0": seqs(PREMISES), "sent1": seqs(ENTAILED), "hard_neg": seqs(CONTRADICTED)}
            return TrainingRows(
                TokenRows(np.arange(len(PREMISES)), cols), None, supervised=True, pad_id=tokenizer.pad_token_id
            )
        text = seqs(SENTENCES * 2)
        tokens = TokenRows(np.arange(len(text)), {"text": text})
        corruption = None
        if kind == "corrupted":
            rng = np.random.default_rng(0)
            cor = []
            for s in text:
                c = s.copy()
                inner = np.arange(len(s))[1:-1]
                c[inner[rng.random(len(inner)) < 0.4]] = rng.integers(2000, 3000)
                cor.append(c)
            corruption = CorruptionRows(
                1, {("text", 0): cor}, {("text", 0): [(c != s).astype(np.int8) for c, s in zip(cor, text)]}
            )
        return TrainingRows(tokens, corruption, supervised=False, pad_id=tokenizer.pad_token_id)

    return make


def _train(model, phases: list[Phase], tmp_path, lr: float = 1e-2) -> Trainer:
    cfg = loop_config(learning_rate=lr, max_steps=2, seed=7, log_steps=100)
    trainer = cpu_trainer(model, phases, cfg, tmp_path / "state")
    trainer.run()
    return trainer


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(before, model) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


@pytest.mark.parametrize("method", ["dcpcse", "d2cse"])
def test_frozen_prompts_receive_no_update_through_the_trainer(method, tiny_bert_dir, tokenizer, rows_of, tmp_path):
    def build(**kw):
        torch.manual_seed(0)
        if method == "d2cse":
            return D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, cls_prompt=True, **kw))
        return DCPCSE(DCPCSEConfig(backbone=str(tiny_bert_dir), prefix_len=3, **kw))

    rows = rows_of("corrupted" if method == "d2cse" else "plain")
    prompt_names = {"encoder.prefix_encoder.embedding.weight"} | ({"cls_prompt"} if method == "d2cse" else set())
    heads = {
        "dcpcse": {"mlp.dense.weight", "mlp.dense.bias"},
        "d2cse": {"projection.net.0.weight", "projection.net.3.weight", "rtd_head.classifier.weight"},
    }[method]

    frozen = build(train_prompts=False)
    assert frozen.describe()["train_prompts"] is False
    before = _snapshot(frozen)
    trainer = _train(frozen, [Phase("main", rows, 4, 1e-2, max_steps=2)], tmp_path / "frozen")
    stepped = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in stepped for n, p in frozen.named_parameters() if n in prompt_names)
    changed = _changed(before, frozen)
    assert heads <= changed and not changed & prompt_names, sorted(changed)

    # the default trains them (the assertion above can fail)
    trained = build()
    before = _snapshot(trained)
    _train(trained, [Phase("main", rows, 4, 1e-2, max_steps=2)], tmp_path / "trained")
    assert prompt_names <= _changed(before, trained)

    # the frozen prompts are saved with the checkpoint (not rebuilt from a fresh random draw)
    save_checkpoint(frozen, tmp_path / "ckpt")
    torch.manual_seed(99)
    loaded = load_checkpoint(tmp_path / "ckpt")
    for name in prompt_names:
        assert torch.equal(dict(loaded.named_parameters())[name], dict(frozen.named_parameters())[name]), name
    enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(
            frozen.eval().embed(enc["input_ids"], enc["attention_mask"]),
            loaded.embed(enc["input_ids"], enc["attention_mask"]),
        )
    # ...and exported as a PEFT adapter, which reproduces the embeddings (checked by the export on its probes)
    export = export_peft_adapter(tmp_path / "ckpt", tmp_path / "adapter")
    assert export.exact


def test_nothing_left_to_train_is_refused_naming_the_field(tiny_bert_dir):
    torch.manual_seed(0)
    model = DCPCSE(DCPCSEConfig(backbone=str(tiny_bert_dir), prefix_len=3, train_prompts=False))
    assert model.trainable_parameter_count() == sum(p.numel() for p in model.mlp.parameters())
    model.mlp.requires_grad_(False)
    with pytest.raises(ValueError, match=r"nothing to train in phase 'main' \(model.train_prompts=False"):
        model.parameter_groups("main")


# ------------------------------------------------------------------------------------------------ DiffAug
MAX_TOKENS, COPIES = 8, 20


def _diffaug(tiny_bert_dir, tokenizer, **overrides) -> DiffAug:
    torch.manual_seed(0)
    return DiffAug(
        DiffAugConfig(backbone=str(tiny_bert_dir), max_sentence_tokens=MAX_TOKENS, denoise_copies=COPIES, **overrides),
        tokenizer=tokenizer,
    )


def test_diffaug_stage_one_moves_only_the_prefix_through_the_trainer(tiny_bert_dir, tokenizer, rows_of, tmp_path):
    model = _diffaug(tiny_bert_dir, tokenizer)
    before = _snapshot(model)
    trainer = _train(model, [Phase("prefix", rows_of("nli"), 4, 1e-3, max_steps=2, cycle=True)], tmp_path)
    assert trainer.step == 2
    changed = _changed(before, model)
    prefix = {n for n, _ in model.named_parameters() if n.startswith("encoder.prefix_encoder.")}
    assert prefix and prefix <= changed  # the embedding rows and the reparametrisation MLP all move
    assert changed - prefix == {"classifier.weight", "classifier.bias"}  # the stage-1 NLI head, nothing else
    assert all(p.requires_grad for p in model.parameters())  # the LM is only excluded during the stage-1 forward


def test_diffaug_shared_prefix_gives_both_views_the_same_module(tiny_bert_dir, tokenizer, monkeypatch):
    enc = tokenizer(SENTENCES, padding=True, truncation=True, max_length=MAX_TOKENS + 2, return_tensors="pt")
    batch = TrainBatch(
        enc["input_ids"].unsqueeze(1).repeat(1, 2, 1), enc["attention_mask"].unsqueeze(1).repeat(1, 2, 1)
    )
    views = {}
    for shared in (False, True):
        # without denoising: δ_A / δ_B would largely cancel the modules' effect on the tiny random model
        model = _diffaug(tiny_bert_dir, tokenizer, shared_prefix=shared, denoise=False)
        with torch.no_grad():  # the random-init halves are nearly alike on the tiny model: make module B distinct
            rows_b = model.prompts.embedding.weight[model.config.module_len :]
            rows_b.copy_(torch.randn(rows_b.shape, generator=torch.Generator().manual_seed(5)))
        assert model.describe()["shared_prefix"] is shared
        modules, z = [], []
        original = model.prefix_sample
        monkeypatch.setattr(
            model,
            "prefix_sample",
            lambda m, rows, modules=modules, original=original: modules.append(m) or original(m, rows),
        )
        model.mlp.register_forward_hook(lambda mod, args, out, z=z: z.append(out))
        model.eval()  # no dropout: the views differ by their prefix module only
        with torch.no_grad():
            model.training_step(batch, phase="joint")
        assert len(modules) == 1 and modules[0].tolist() == ([0, 0] * B if shared else [0, 1] * B)
        views[shared] = z[0].view(B, 2, -1)
    assert torch.equal(views[True][:, 0], views[True][:, 1])  # one module: identical positives without dropout
    assert (views[False][:, 0] - views[False][:, 1]).abs().max() > 1e-5  # A and B: different positives
    torch.testing.assert_close(views[True][:, 0], views[False][:, 0], rtol=0, atol=0)  # view 1 keeps module A

    # with denoising every main row subtracts δ_A; stage 1 still pairs the premise (A) with the hypotheses (B)
    model = _diffaug(tiny_bert_dir, tokenizer, shared_prefix=True)
    denoised = []
    original = model.denoise
    monkeypatch.setattr(model, "denoise", lambda s, lengths, m: denoised.append(m) or original(s, lengths, m))
    model.training_step(batch, phase="joint")
    assert denoised[0].tolist() == [0, 0] * B
    assert model.view_modules(2, 3, torch.device("cpu")).tolist() == [0, 1, 1, 0, 1, 1]


# ------------------------------------------------------------------------------------------------ SimCSE dropout
def _simcse_twice(backbone_dir, tokenizer, dropout, backbone=None):
    torch.manual_seed(0)
    model = SimCSE(SimCSEConfig(backbone=str(backbone_dir), dropout=dropout), backbone=backbone, tokenizer=tokenizer)
    model.train()
    enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].unsqueeze(1).repeat(1, 2, 1), enc["attention_mask"].unsqueeze(1).repeat(1, 2, 1)
    (_, z1), (_, z2) = model(ids, mask), model(ids, mask)
    return model, z1, z2


def test_simcse_dropout_zero_makes_two_train_passes_identical(tiny_bert_dir, tokenizer):
    model, z1, z2 = _simcse_twice(tiny_bert_dir, tokenizer, 0.0)
    assert torch.equal(z1, z2) and torch.equal(z1[:, 0], z1[:, 1])  # the two views of a sentence are identical too
    assert model.describe()["dropout"] == 0.0
    assert model.encoder.config.hidden_dropout_prob == model.encoder.config.attention_probs_dropout_prob == 0.0
    _, z1, z2 = _simcse_twice(tiny_bert_dir, tokenizer, None)  # the backbone's own 0.1
    assert (z1 - z2).abs().max() > 1e-4 and (z1[:, 0] - z1[:, 1]).abs().max() > 1e-4

    # the attention-probability dropout alone (transformers' sdpa path) is switched off as well
    cfg = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.5,
    )
    for dropout, identical in ((None, False), (0.0, True)):
        torch.manual_seed(0)
        _, z1, z2 = _simcse_twice(tiny_bert_dir, tokenizer, dropout, backbone=BertModel(cfg))
        assert torch.equal(z1, z2) is identical, dropout


@pytest.mark.parametrize("bad", [-0.1, 1.0, True])
def test_simcse_dropout_is_validated(bad):
    with pytest.raises(ValueError, match="dropout must be None"):
        SimCSEConfig(backbone="x", dropout=bad)
