"""Unpadded passes (`speed.unpadded_fill`, cse.models.prompts.packing) give the padded step's loss and gradients.

Every method's training step on rows of 5 to 9 real tokens padded to 12, run padded and run unpadded (the encoder
and, where its loss reads real tokens only, the discriminator over a fixed budget of packed token slots smaller
than the padded positions), on a tiny random BERT with every dropout off (the packed pass draws its dropout masks
over the packed shape: the same distribution, other draws). Losses and gradients equal within the scale rule of
docs/tests.md (`tests/tolerance.py`, terms = rows × positions). The packed backbone call is checked against the
padded one with a prefix sample that differs per row and per prefix slot mask, a [CLS] prompt and position-0
vectors: each row's tokens see their own prefix only, and every real position's state is the padded pass's; so is
it for RoBERTa (positions from the padding id) and ELECTRA (an embedding projection); a family the packed pass
does not reach is refused. A job with `speed.unpadded_fill` trains unpadded through `cse.training.job.fit`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from cse.models.prompts.backbone import PromptedBackbone
from cse.models.prompts.packing import packed_budget, packed_index
from cse.models.prompts.prefixes import PrefixKeyValues
from tests.tolerance import assert_close_scaled
from tests.training.test_speed import BATCH, CASES, LENGTH, _case, _pad, _shorten, _step

FILL = 0.7  # budget: 0.7 of the padded positions; the rows fill 27/48 = 0.56 of them (DiffAug's templated rows more)

# (method, model overrides, phase, fill): every method; D2CSE's ablations and [CLS] prompt; the discriminator packed
# where the RTD mean reads real tokens only (rtd_mean_over_padding=False); DiffAug's templated rows are fuller
UNPADDED_CASES = {
    "simcse": ("simcse", {}, "main", FILL),
    "simcse-sup": ("simcse", {"mlp_only_train": False}, "main", FILL),
    "d2cse": ("d2cse", {}, "main", FILL),
    "d2cse-cls-prompt-real-rtd": ("d2cse", {"cls_prompt": True, "rtd_mean_over_padding": False}, "main", FILL),
    "d2cse-ablation-a": ("d2cse", {"discriminator_prompts": False, "rtd_mean_over_padding": False}, "main", FILL),
    "d2cse-ablation-b": (
        "d2cse",
        {"discriminator_prompts": False, "train_discriminator": True, "rtd_mean_over_padding": False},
        "main",
        FILL,
    ),
    "d2cse-ablation-c": ("d2cse", {"condition_discriminator": False}, "main", FILL),
    "dcpcse": ("dcpcse", {"mlm": False}, "main", FILL),
    "dcpcse-mlm": ("dcpcse", {"mlm": True}, "main", FILL),
    "diffcse": ("diffcse", {}, "main", FILL),
    "diffcse-real-rtd": ("diffcse", {"rtd_mean_over_padding": False}, "main", FILL),
    "diffaug-prefix": ("diffaug", {}, "prefix", 0.85),
    "diffaug-joint": ("diffaug", {"temperature": 1.0}, "joint", 0.85),
}


@pytest.fixture(scope="module")
def tok():
    from benchmarks.gpu_check import synthetic_tokenizer

    return synthetic_tokenizer()


@pytest.fixture
def packed_calls(monkeypatch):
    """The `(rows, length)` and budget of every packed backbone call."""
    calls: list[tuple[tuple[int, int], int]] = []
    original = PromptedBackbone.packed_call

    def spy(self, kwargs, token_mask, prefix, position0_output, fill):
        calls.append((tuple(token_mask.shape), packed_budget(*token_mask.shape, fill)))
        return original(self, kwargs, token_mask, prefix, position0_output, fill)

    monkeypatch.setattr(PromptedBackbone, "packed_call", spy)
    return calls


def _padded_and_unpadded(name, tok):
    """(padded model, unpadded twin, the batch of 5…9-token rows padded to 12, phase, fill)."""
    method, overrides, phase, fill = UNPADDED_CASES[name]
    CASES[f"unpadded-{name}"] = (method, overrides, phase)
    try:
        model, batch, _ = _case(f"unpadded-{name}", tok, pad_to=None)
    finally:
        del CASES[f"unpadded-{name}"]
    wide = _pad(_shorten(batch), LENGTH)
    twin = copy.deepcopy(model)
    twin.use_unpadded(fill)
    return model, twin, wide, phase, fill


def _assert_equal_steps(got, expected, rows: int) -> None:
    (got_loss, got_grads), (loss, grads) = got, expected
    terms = rows * LENGTH
    assert got_grads.keys() == grads.keys() and grads
    assert_close_scaled(got_loss, loss, terms=terms)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert scale > 0
    for n, g in grads.items():
        assert_close_scaled(got_grads[n], g, terms=terms, scale=scale, msg=n)


@pytest.mark.parametrize("name", list(UNPADDED_CASES))
def test_the_unpadded_step_gives_the_padded_steps_loss_and_gradients(name, tok, packed_calls):
    model, twin, batch, phase, _ = _padded_and_unpadded(name, tok)
    expected = _step(model, model.training_step, batch, phase)
    assert not packed_calls  # the padded model never packs
    got = _step(twin, twin.training_step, batch, phase)
    assert packed_calls  # the unpadded twin did, below the padded positions
    assert all(budget < rows * length for (rows, length), budget in packed_calls)
    method, overrides, _, _ = UNPADDED_CASES[name]
    if method in ("d2cse", "diffcse"):  # the discriminator packs exactly when the RTD mean reads real tokens only
        assert len(packed_calls) == (1 if overrides.get("rtd_mean_over_padding", True) else 2)
    assert expected[0].abs() > 0
    _assert_equal_steps(got, expected, rows=batch.input_ids.shape[0] * batch.input_ids.shape[1])


@pytest.mark.parametrize("name", ["simcse", "d2cse-cls-prompt-real-rtd"])
def test_the_unpadded_step_compiles_as_one_graph_equal_to_the_padded_eager_step(name, tok):
    model, twin, batch, phase, _ = _padded_and_unpadded(name, tok)
    expected = _step(model, model.training_step, batch, phase)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin.training_step, fullgraph=True, backend=counter)
    got = _step(twin, compiled, batch, phase, step=torch.tensor(3))
    assert counter.frame_count == 1
    _assert_equal_steps(got, expected, rows=batch.input_ids.shape[0] * batch.input_ids.shape[1])


def test_more_real_tokens_than_the_budget_is_refused(tok):
    model, twin, batch, phase, _ = _padded_and_unpadded("simcse", tok)
    twin.use_unpadded(0.25)  # 24 slots for 54 real tokens
    with pytest.raises(ValueError, match="54 real tokens, more than the unpadded budget of 24"):
        twin.training_step(batch, 0, phase)


def test_a_fill_outside_zero_to_one_is_refused(tok):
    model, *_ = _padded_and_unpadded("simcse", tok)
    for fill in (0.0, 1.5):
        with pytest.raises(ValueError, match="fill must be in"):
            model.use_unpadded(fill)


def test_the_packed_index_holds_the_real_tokens_in_row_order_then_pad_positions():
    mask = (torch.arange(8)[None, :] < torch.tensor([2, 3, 1, 4])[:, None]).long()
    index = packed_index(mask, 0.5)  # budget 16 of 32 positions: the 10 real tokens, then the first 6 pad positions
    assert index.tolist() == [0, 1, 8, 9, 10, 16, 24, 25, 26, 27, 2, 3, 4, 5, 6, 7]
    assert packed_budget(128, 32, 0.8) == 3280 and packed_budget(3, 4, 1.0) == 12


def test_each_row_sees_its_own_prefix_its_cls_prompt_and_position0_vector(tok):
    """The packed backbone call against the padded one on rows of distinct prefix samples (per row and per slot
    mask): every real position's last state equal, so no row's tokens read another row's prefix or tokens."""
    model, twin, batch, _, _ = _padded_and_unpadded("d2cse-cls-prompt-real-rtd", tok)
    enc = model.encoder
    rows = batch.flat(batch.input_ids)
    mask = batch.flat(batch.attention_mask)
    g = torch.Generator().manual_seed(5)
    shape = (rows.shape[0], enc.num_heads, 4, enc.hidden_size // enc.num_heads)
    layers = tuple((torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(enc.num_layers))
    slots = (torch.rand(rows.shape[0], 4, generator=g) > 0.4).long()
    prefix = PrefixKeyValues(layers, slots)
    h = torch.randn(rows.shape[0], enc.hidden_size, generator=g)
    cls = torch.randn(enc.backbone.get_input_embeddings().weight.shape[1], generator=g)

    def states(fill):
        enc.unpad(fill)
        out = enc(rows, mask, prefix=prefix, cls_embedding=cls, position0_output=h, output_hidden_states=True)
        return out.last_hidden_state, out.hidden_states

    padded, padded_all = states(None)
    packed, packed_all = states(0.6)
    real = mask.bool()
    assert_close_scaled(packed[real], padded[real], terms=LENGTH)
    not_computed = int((packed[~real].abs().sum(-1) == 0).sum())
    assert not_computed == rows.numel() - packed_budget(*rows.shape, 0.6) > 0  # the pad positions past the budget
    for got, want in zip(packed_all, padded_all):
        assert_close_scaled(got[real], want[real], terms=LENGTH)


def test_the_option_off_leaves_the_step_padded(tok, packed_calls):
    model, twin, batch, phase, _ = _padded_and_unpadded("simcse", tok)
    twin.use_unpadded(None)
    _step(twin, twin.training_step, batch, phase)
    assert not packed_calls
    assert BATCH == batch.input_ids.shape[0]


@pytest.mark.parametrize("method", ["simcse", "d2cse"])
def test_a_job_with_speed_unpadded_fill_trains_unpadded(method, tmp_path, packed_calls):
    """`speed.unpadded_fill` reaches the model through `cse.training.job.fit`: three steps of the default preset
    (dropout on) run packed passes and log finite losses."""
    import math

    from benchmarks.step_fingerprint import fingerprint

    found = fingerprint([method], tmp_path, {"speed": {"unpadded_fill": 1.0}})[method]  # (rows padded to the longest)
    assert packed_calls
    losses = [float(log["loss"]) for log in found["logged"] if "loss" in log]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_the_packed_pass_of_each_supported_family_equals_the_padded_one(family):
    """BERT (absolute positions), RoBERTa (positions numbered from the padding id, shifted by the prefix) and ELECTRA
    (an embedding projection), prompted, dropout 0, in train mode: every real position's state equal."""
    from transformers import BertConfig, BertModel, ElectraConfig, ElectraModel, RobertaConfig, RobertaModel

    from cse.models.prompts.backbone import prompted_backbone

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=300)
    shape.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = {
        "bert": lambda: BertModel(BertConfig(**shape), add_pooling_layer=False),
        "roberta": lambda: RobertaModel(RobertaConfig(pad_token_id=1, **shape), add_pooling_layer=False),
        "electra": lambda: ElectraModel(ElectraConfig(embedding_size=16, **shape)),
    }[family]()
    enc = prompted_backbone(model, prefix_len=4, dropout=0.0).train()
    lengths = torch.tensor([3, 7, 5, 2, 6, 4])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    pad = 1 if family == "roberta" else 0
    ids = torch.where(mask.bool(), torch.randint(5, 300, (6, 8)), torch.full((6, 8), pad))
    h = torch.randn(6, 32)
    prefix = enc.prefix_encoder(6)

    def states(fill):
        enc.unpad(fill)
        return enc(ids, mask, prefix=prefix, position0_output=h).last_hidden_state

    padded, packed = states(None), states(0.6)
    assert_close_scaled(packed[mask.bool()], padded[mask.bool()], terms=8)


def test_an_unsupported_family_is_refused():
    from transformers import DistilBertConfig, DistilBertModel

    from cse.models.prompts.backbone import prompted_backbone

    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=4, hidden_dim=64)
    enc = prompted_backbone(DistilBertModel(config), prefix_len=2)
    with pytest.raises(TypeError, match="DistilBERT .*unpadded passes need a BERT-style family"):
        enc.unpad(0.8)
