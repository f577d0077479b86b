"""The DiffAug model (models/methods/diffaug.py): template, prefix halves, both stages, denoising, counts (Wang & Lu, 2022)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from cse.config.methods import build_model
from cse.models.batching import TrainBatch
from cse.models.checkpoint import load_checkpoint, save_checkpoint
from cse.models.losses import contrastive_loss
from cse.models.methods.diffaug import DiffAug, DiffAugConfig
from cse.models.prompts.prefixes import PrefixKeyValues

MAX_TOKENS = 8
COPIES = MAX_TOKENS + 8 + 4  # > the quirk index max_sentence_tokens + prefix_len/2

SENTENCES = [
    "a man is playing a guitar on the stage in front of many people tonight .",
    "the cat sleeps",
    "two dogs run on the beach",
    "it rains",
]
ENTAILED = ["a person plays music .", "an animal rests", "dogs are outside", "the weather is wet"]
CONTRADICTED = ["nobody is playing .", "the cat is running around the house", "no dogs", "it is sunny and dry"]


@pytest.fixture
def make_model(tiny_bert_dir, tokenizer):
    def make(**overrides) -> DiffAug:
        torch.manual_seed(0)
        cfg = dict(backbone=str(tiny_bert_dir), max_sentence_tokens=MAX_TOKENS, denoise_copies=COPIES)
        cfg.update(overrides)
        return DiffAug(DiffAugConfig(**cfg), tokenizer=tokenizer)

    return make


def _rows(tokenizer, sentences):
    """`[CLS] sentence [SEP]` rows, right-padded, as the tokenisation stage writes them (max_length 34 = 32 + 2)."""
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=34, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _unsup(tokenizer, sentences=SENTENCES) -> TrainBatch:
    ids, mask = _rows(tokenizer, sentences)
    return TrainBatch(ids.unsqueeze(1).repeat(1, 2, 1), mask.unsqueeze(1).repeat(1, 2, 1))


def _nli(tokenizer) -> TrainBatch:
    ids, mask = _rows(tokenizer, SENTENCES + ENTAILED + CONTRADICTED)
    b = len(SENTENCES)
    return TrainBatch(ids.view(3, b, -1).transpose(0, 1).contiguous(), mask.view(3, b, -1).transpose(0, 1).contiguous())


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if not torch.equal(before[n], p.detach())}


def _record_prefix_masks(model: DiffAug, monkeypatch) -> list[torch.Tensor | None]:
    """Every forward's prefix visibility mask (None = all slots visible)."""
    seen: list[torch.Tensor | None] = []
    inner = model.encoder.forward

    def forward(*args, prefix=True, **kwargs):
        assert isinstance(prefix, PrefixKeyValues)
        seen.append(None if prefix.mask is None else prefix.mask.detach().clone())
        return inner(*args, prefix=prefix, **kwargs)

    monkeypatch.setattr(model.encoder, "forward", forward)
    return seen


# ------------------------------------------------------------------------------------------------ template
def test_training_rows_are_wrapped_in_the_template_and_cut(make_model, tokenizer):
    model = make_model()
    ids, mask = _rows(tokenizer, SENTENCES)
    wrapped, wmask, lengths, mask_pos = model.wrap_rows(ids, mask)
    assert model.enc_bs == tokenizer.convert_tokens_to_ids(["[CLS]", "this", "sentence", "of", '"'])
    assert model.enc_es == tokenizer.convert_tokens_to_ids(['"', "means", "[MASK]", ".", "[SEP]"])
    for r, s in enumerate(SENTENCES):
        words = tokenizer.encode(s, add_special_tokens=False)[:MAX_TOKENS]
        toks = tokenizer.convert_ids_to_tokens(wrapped[r][wmask[r].bool()].tolist())
        assert toks == [
            "[CLS]",
            "this",
            "sentence",
            "of",
            '"',
            *tokenizer.convert_ids_to_tokens(words),
            '"',
            "means",
            "[MASK]",
            ".",
            "[SEP]",
        ]
        assert lengths[r] == len(words) and wrapped[r, mask_pos[r]] == tokenizer.mask_token_id
        assert (wrapped[r][~wmask[r].bool()] == tokenizer.pad_token_id).all()
    assert lengths[0] == MAX_TOKENS  # the long sentence is cut to max_sentence_tokens
    assert wrapped.shape[1] == 10 + MAX_TOKENS
    with pytest.raises(ValueError, match=r"\[CLS\] sentence \[SEP\]"):
        model.wrap_rows(ids[:, 1:], mask[:, 1:])  # rows without [CLS]


def test_evaluation_token_ids_use_the_plain_template(make_model, tokenizer):
    model = make_model()
    got = model.token_ids(["A man plays.", "hi"])
    assert got[0] == tokenizer('This sentence of "A man plays." means[MASK].')["input_ids"]
    assert tokenizer.convert_ids_to_tokens(got[1]) == [
        "[CLS]",
        "this",
        "sentence",
        "of",
        '"',
        "hi",
        '"',
        "means",
        "[MASK]",
        ".",
        "[SEP]",
    ]
    long = " ".join(["word"] * 100)
    assert len(model.token_ids([long])[0]) == 100 + 10  # no truncation at evaluation


def test_config_validation():
    with pytest.raises(ValueError, match="even"):
        DiffAugConfig(backbone="x", prefix_len=15)
    with pytest.raises(ValueError, match="denoise_copies"):
        DiffAugConfig(backbone="x", max_sentence_tokens=32, denoise_copies=40)  # quirk index reaches 40
    DiffAugConfig(backbone="x", max_sentence_tokens=32, denoise_copies=40, denoise_index_quirk=False)
    with pytest.raises(ValueError, match="sentence"):
        DiffAugConfig(backbone="x", template="no placeholder [MASK]")
    defaults = DiffAugConfig(backbone="x")
    assert (
        defaults.prefix_len,
        defaults.prefix_dropout,
        defaults.max_sentence_tokens,
        defaults.temperature,
        defaults.aux_weight,
        defaults.denoise,
        defaults.denoise_copies,
        defaults.denoise_index_quirk,
        defaults.shift_positions,
    ) == (16, 0.1, 32, 0.05, 0.0, True, 128, True, True)


# ------------------------------------------------------------------------------------------------ prefixes
def test_prefix_visibility_masks_per_role(make_model, tokenizer, monkeypatch):
    model = make_model(aux_weight=0.5)
    a, b = [1] * 8 + [0] * 8, [0] * 8 + [1] * 8
    assert model.module_visibility(torch.tensor([0, 1])).tolist() == [a, b]
    seen = _record_prefix_masks(model, monkeypatch)

    model.training_step(_nli(tokenizer), phase="prefix")
    assert seen[-1].tolist() == [a, b, b] * 4  # premise A; entailment, contradiction B

    unsup = _unsup(tokenizer)
    unsup.aux = _nli(tokenizer)
    seen.clear()
    model.training_step(unsup, phase="joint")
    main, deltas = seen  # one pass over main + aux rows, then the denoising pass
    assert main.tolist() == [a, b] * 4 + [a, b, b] * 4
    assert deltas.tolist() == [a] * COPIES + [b] * COPIES

    seen.clear()
    model.eval()
    ids, mask = _rows(tokenizer, ['This sentence of "hi" means[MASK].'])
    model.embed(ids, mask)
    assert seen == [None]  # inference: all 16 slots visible


def test_embed_reads_the_mask_state_with_all_slots_and_no_mlp(make_model, tokenizer):
    model = make_model().eval()
    enc = tokenizer(
        [model.eval_head + s + model.eval_tail for s in ["a cat", "two dogs run"]], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        emb = model.embed(enc["input_ids"], enc["attention_mask"])
        hidden = model.encoder(enc["input_ids"], enc["attention_mask"], prefix=model.prompts(2)).last_hidden_state
    pos = (enc["input_ids"] == tokenizer.mask_token_id).float().argmax(1)
    assert torch.equal(emb, hidden[torch.arange(2), pos])
    assert model.evaluation_pooler == "mask"


# ------------------------------------------------------------------------------------------------ stages
def test_prefix_stage_steps_only_prefix_encoder_and_classifier(make_model, tokenizer):
    model = make_model().train()
    params = model.phase_parameters("prefix")
    assert {id(p) for p in params} == {id(p) for p in [*model.prompts.parameters(), *model.classifier.parameters()]}
    before = _snapshot(model)
    opt = torch.optim.AdamW(params, lr=1e-3)
    batch = _nli(tokenizer)
    for _ in range(2):
        out = model.training_step(batch, phase="prefix")
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    changed = _changed(before, model)
    assert changed == {
        n for n, _ in model.named_parameters() if n.startswith(("encoder.prefix_encoder.", "classifier."))
    }
    assert all(p.requires_grad for p in model.parameters())  # restored after the stage-1 forward
    assert all(p.grad is None for p in [*model.backbone.parameters(), *model.mlp.parameters()])
    assert set(out.metrics) == {"loss_nli", "nli_accuracy"}
    assert 0.0 <= out.metrics["nli_accuracy"].item() <= 1.0


def test_joint_stage_steps_everything(make_model, tokenizer):
    model = make_model().train()
    assert len(model.phase_parameters("joint")) == len(list(model.parameters()))
    assert model.trainable_parameter_count() == sum(p.numel() for p in model.parameters())
    before = _snapshot(model)
    opt = torch.optim.AdamW(model.phase_parameters("joint"), lr=1e-3)
    out = model.training_step(_unsup(tokenizer), phase="joint")
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    changed = _changed(before, model)
    lm = {n for n, _ in model.named_parameters() if n.startswith("encoder.backbone.")}
    assert "encoder.backbone.embeddings.word_embeddings.weight" in changed
    assert {n for n in lm if ".layer.1." in n} <= changed
    assert {"mlp.dense.weight", "encoder.prefix_encoder.embedding.weight"} <= changed
    assert not any(n.startswith("classifier.") for n in changed)  # no NLI loss without aux
    assert set(out.metrics) == {"loss_contrastive"}


def _hard_unsup(tokenizer) -> TrainBatch:
    """Near-duplicate sentences, so that the unsupervised contrastive loss of the tiny model is not ~0 from the start."""
    return _unsup(
        tokenizer,
        [f"a man is playing a {w} on the stage ." for w in ("guitar", "piano", "drum", "violin", "flute", "harp")],
    )


@pytest.mark.parametrize("phase,batch_of", [("prefix", _nli), ("joint", _hard_unsup), ("joint", _nli)])
def test_loss_decreases_on_a_fixed_batch(make_model, tokenizer, phase, batch_of):
    model = make_model().train()
    batch = batch_of(tokenizer)
    opt = torch.optim.AdamW(model.phase_parameters(phase), lr=3e-3)
    losses = []
    for _ in range(6):
        torch.manual_seed(1)  # the same dropout draw every step: the loss is a function of the parameters only
        out = model.training_step(batch, phase=phase)
        losses.append(out.loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert losses[-1] < losses[0], losses


def test_aux_loss_path(make_model, tokenizer):
    model = make_model(aux_weight=0.5).eval()
    batch = _unsup(tokenizer)
    with pytest.raises(ValueError, match="aux"):
        model.training_step(batch, phase="joint")
    batch.aux = _nli(tokenizer)
    out = model.training_step(batch, phase="joint")
    assert set(out.metrics) == {"loss_contrastive", "loss_nli", "nli_accuracy"}
    assert out.loss.item() == pytest.approx(
        out.metrics["loss_contrastive"].item() + 0.5 * out.metrics["loss_nli"].item(), rel=1e-6
    )
    out.loss.backward()
    assert model.classifier.weight.grad is not None and model.classifier.weight.grad.abs().sum() > 0
    # main rows are unaffected by the auxiliary rows sharing their forward (padding to a common length)
    plain = make_model(aux_weight=0.0).eval()
    plain.load_state_dict(model.state_dict())
    alone = plain.training_step(batch, phase="joint")  # α = 0: aux ignored
    assert set(alone.metrics) == {"loss_contrastive"}
    assert alone.loss.item() == pytest.approx(out.metrics["loss_contrastive"].item(), abs=1e-5)
    # the stage-1 NLI loss on the aux batch equals the auxiliary term (aux rows are not denoised)
    nli = model.training_step(batch.aux, phase="prefix")
    assert nli.loss.item() == pytest.approx(out.metrics["loss_nli"].item(), abs=1e-5)


def test_supervised_triplets_use_all_hard_negatives(make_model, tokenizer):
    model = make_model().eval()
    batch = _nli(tokenizer)
    out = model.training_step(batch, phase="joint")
    b, n, _ = batch.input_ids.shape
    modules = model.view_modules(b, n, torch.device("cpu"))
    assert modules.tolist() == [0, 1, 1] * b
    with torch.no_grad():
        states, lengths = model.mask_states(batch.flat(batch.input_ids), batch.flat(batch.attention_mask), modules)
        z = model.mlp(model.denoise(states, lengths, modules)).view(b, n, -1)
        want = contrastive_loss(z[:, 0], z[:, 1], z[:, 2], temperature=0.05)
        without = contrastive_loss(z[:, 0], z[:, 1], temperature=0.05)
    assert out.loss.item() == pytest.approx(want.item(), abs=1e-5)
    assert abs(want.item() - without.item()) > 1e-4


# ------------------------------------------------------------------------------------------------ denoising
def test_denoising_template_positions_and_empty_sentence(make_model, tokenizer):
    model = make_model().eval()
    pos = model.denoise_positions
    assert pos.shape == (COPIES, 10)
    for k in (0, 3, MAX_TOKENS):  # copy k places enc_es where a k-token sentence would put it (shift 16)
        row = list(range(16, 16 + 10 + k))
        assert pos[k].tolist() == row[:5] + row[5 + k :]
    ids, mask = _rows(tokenizer, [""])  # an empty sentence: exactly the bare template at the default positions
    with torch.no_grad():
        deltas = model.template_deltas()
        for module in (0, 1):
            state, lengths = model.mask_states(ids, mask, torch.tensor([module]))
            assert lengths.tolist() == [0]
            torch.testing.assert_close(deltas[module, 0], state[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(deltas[0, 0], deltas[1, 0])  # the two modules differ


@pytest.mark.parametrize("quirk", [True, False])
def test_denoising_index_and_module_selection(make_model, monkeypatch, quirk):
    model = make_model(denoise_index_quirk=quirk)
    d = model.hidden_size
    fake = torch.arange(2 * COPIES, dtype=torch.float).view(2, COPIES, 1).expand(2, COPIES, d) * torch.tensor(
        [1.0, 1000.0]
    ).view(2, 1, 1)
    monkeypatch.setattr(model, "template_deltas", lambda: fake)
    lengths = torch.tensor([0, 3, MAX_TOKENS, 5])
    modules = torch.tensor([0, 1, 0, 1])
    out = model.denoise(torch.zeros(4, d), lengths, modules)
    k = lengths + (8 if quirk else 0)
    assert out[:, 0].tolist() == [-fake[m, i, 0].item() for m, i in zip(modules.tolist(), k.tolist())]


def test_denoising_only_in_the_joint_stage_and_behind_its_flag(make_model, tokenizer, monkeypatch):
    calls = []
    for denoise in (True, False):
        model = make_model(denoise=denoise).train()
        inner = model.template_deltas
        monkeypatch.setattr(
            model, "template_deltas", lambda inner=inner, denoise=denoise: calls.append(denoise) or inner()
        )
        model.training_step(_nli(tokenizer), phase="prefix")
        model.training_step(_unsup(tokenizer), phase="joint")
    assert calls == [True]


# ------------------------------------------------------------------------------------------------ counts, registry, checkpoint
def test_bert_base_parameter_arithmetic(tokenizer):
    torch.manual_seed(0)
    backbone = BertModel(BertConfig())  # 12 layers, 768, vocab 30522; random weights
    lm_without_pooler = sum(p.numel() for n, p in backbone.named_parameters() if not n.startswith("pooler."))
    model = DiffAug(DiffAugConfig(backbone="bert-base-uncased"), backbone=backbone, tokenizer=tokenizer)
    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)
    pe = model.prompts
    assert (pe.embedding.weight.numel(), count(pe.transform[0]), count(pe.transform[2])) == (
        12_288,
        590_592,
        14_174_208,
    )
    assert count(pe) == 14_777_088
    assert pe.rows().numel() == 294_912  # the resulting K/V tensor (the paper's "0.3 %")
    assert count(model.mlp) == 590_592
    assert count(model.classifier) == 4_610
    assert lm_without_pooler == 108_891_648 and model.backbone.pooler is None
    assert count(model) == lm_without_pooler + 14_777_088 + 590_592 + 4_610 == 124_263_938
    assert sum(p.numel() for p in model.phase_parameters("prefix")) == 14_777_088 + 4_610


def test_registry_builds_diffaug(tiny_bert_dir, tokenizer, make_model):
    torch.manual_seed(0)
    model = build_model(
        "diffaug",
        {"backbone": str(tiny_bert_dir), "max_sentence_tokens": MAX_TOKENS, "denoise_copies": COPIES},
        tokenizer=tokenizer,
    )
    direct = make_model()  # the same config and seed, built without the registry
    assert type(model) is DiffAug and model.phases == ("prefix", "joint") and model.tokenizer is tokenizer
    assert model.config == direct.config and (model.config.max_sentence_tokens, model.config.denoise_copies) == (
        MAX_TOKENS,
        COPIES,
    )
    want = direct.state_dict()
    assert set(model.state_dict()) == set(want)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="unknown"):
        build_model("diffaug", {"backbone": str(tiny_bert_dir), "prefix_lenn": 3}, tokenizer=tokenizer)


def test_checkpoint_round_trip_gives_identical_embeddings(make_model, tokenizer, tmp_path):
    model = make_model().train()
    opt = torch.optim.AdamW(model.phase_parameters("joint"), lr=1e-3)
    out = model.training_step(_unsup(tokenizer), phase="joint")
    out.loss.backward()
    opt.step()  # the LM moves away from the pretrained weights: the checkpoint must carry it
    model.eval()
    folder = save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(folder)
    assert isinstance(loaded, DiffAug) and not loaded.training
    ids = model.token_ids(["a man is playing a guitar .", "the cat sleeps"])
    width = max(map(len, ids))
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    with torch.no_grad():
        assert torch.equal(model.embed(input_ids, mask), loaded.embed(input_ids, mask))


def test_prompted_backbone_explicit_position_ids(make_model, tokenizer):
    """The optional `position_ids` of `PromptedBackbone.forward` (added for the denoising pass): used as given."""
    model = make_model().eval()
    ids, mask = _rows(tokenizer, ["a cat", "two dogs run"])
    prefix = model.prompts(2)
    with torch.no_grad():
        default = model.encoder(ids, mask, prefix=prefix).last_hidden_state
        same = model.encoder(
            ids, mask, prefix=prefix, position_ids=model.encoder.position_ids(ids, 16)
        ).last_hidden_state
        other = model.encoder(
            ids, mask, prefix=prefix, position_ids=model.encoder.position_ids(ids, 0)
        ).last_hidden_state
    assert torch.equal(default, same) and not torch.allclose(default, other)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.encoder(ids, mask, prefix=prefix, position_ids=model.encoder.position_ids(ids, 0) + 127)
    with pytest.raises(ValueError, match="shape"):
        model.encoder(ids, mask, prefix=prefix, position_ids=model.encoder.position_ids(ids, 0)[:, :2])
