"""PEFT prefix-tuning export (models/export/peft_export.py) and its stock-library loader (models/export/peft_loader.py).

Every prompt method's checkpoint (D2CSE with the [CLS] prompt on BERT and on RoBERTa with a reparametrised prefix,
supervised DCPCSE with its MLP, DiffAug with its fine-tuned encoder and template) is exported; the adapter folder's own
`peft_embed.py` (transformers + peft only) must reproduce our `embed` within 1e-5 on STS-B test sentences. Also: the
folder is plain PEFT, the loader imports nothing of ours, sentence-transformers' `load_adapter` refuses prompt adapters
(the documented wrap route works), inexpressible settings are refused or marked inexact, bad targets are refused.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cse.models.checkpoint import load_checkpoint, save_checkpoint
from cse.models.export.peft_export import (
    LOADER_FILE,
    TOLERANCE,
    PeftExportError,
    export_peft_adapter,
    reference_embeddings,
)
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.models.methods.dcpcse import DCPCSE, DCPCSEConfig
from cse.models.methods.diffaug import DiffAug, DiffAugConfig
from cse.models.methods.simcse import SimCSE, SimCSEConfig
from cse.storage.readers import read_senteval

D = 32
# case → (backbone fixture, method class, config overrides, expected pooling, expected modules_to_save)
CASES = {
    "d2cse-bert-cls-prompt": (
        "tiny_bert_dir",
        D2CSE,
        dict(prefix_len=4, cls_prompt=True),
        "cls",
        ["embeddings.position_embeddings"],
    ),
    "d2cse-roberta-cls-prompt-projection": (
        "tiny_roberta_dir",
        D2CSE,
        dict(prefix_len=5, cls_prompt=True, prefix_projection=True, prefix_hidden=16),
        "cls",
        ["embeddings.position_embeddings"],
    ),
    "dcpcse-bert-sup": ("tiny_bert_dir", DCPCSE, dict(prefix_len=3, mlp_only_train=False), "pooler_output", ["pooler"]),
    "diffaug-bert": ("tiny_bert_dir", DiffAug, dict(denoise_copies=48), "mask", []),
}
CONFIGS = {D2CSE: D2CSEModelConfig, DCPCSE: DCPCSEConfig, DiffAug: DiffAugConfig}


@pytest.fixture(scope="module")
def stsb_test_sentences(shared_data) -> list[str]:
    """The distinct sentences of the STS-B test pairs (2,551), through the project's SentEval reader."""
    table, _ = read_senteval(shared_data / "senteval")
    df = table.to_pandas()
    rows = df[(df.task == "stsb") & (df.split == "test")]
    assert len(rows) == 1379
    return sorted(set(rows.sentence1) | set(rows.sentence2))


@pytest.fixture(scope="module")
def tiny_roberta_dir(tmp_path_factory, tokenizer) -> Path:
    """A random 2-layer RoBERTa (hidden 32) with the bert-base-uncased vocabulary; pad id 0 = RoBERTa's padding_idx."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("tiny_roberta")
    cfg = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=130,
        pad_token_id=tokenizer.pad_token_id,
        type_vocab_size=1,
    )
    RobertaModel(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def _trained_checkpoint(cls, backbone_dir, folder, **overrides) -> Path:
    """A checkpoint whose trainable tensors are moved well away from their init (prompts, [CLS] prompt, MLP, and the
    encoder for DiffAug), so an adapter that dropped any of them would fail the comparison."""
    torch.manual_seed(0)
    model = cls(CONFIGS[cls](backbone=str(backbone_dir), **overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5)
    return save_checkpoint(model.eval(), folder)


def _loader(folder: Path):
    """The adapter folder's own `peft_embed.py`, imported from that file (not from this project)."""
    spec = importlib.util.spec_from_file_location(f"peft_embed_{abs(hash(str(folder)))}", folder / LOADER_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exports(request, tmp_path_factory):
    """`get(case) -> (case, checkpoint, PeftExport)`, each case trained, saved and exported once per module."""
    done = {}

    def get(case: str):
        if case not in done:
            fixture, cls, overrides, _, _ = CASES[case]
            root = tmp_path_factory.mktemp(case)
            checkpoint = _trained_checkpoint(cls, request.getfixturevalue(fixture), root / "best", **overrides)
            done[case] = case, checkpoint, export_peft_adapter(checkpoint, root / "adapter")
        return done[case]

    return get


@pytest.fixture(params=sorted(CASES))
def exported(request, exports):
    return exports(request.param)


def test_adapter_reproduces_our_embeddings_on_the_stsb_test_sentences(exported, stsb_test_sentences):
    """Every 8th distinct STS-B test sentence (319 of 2,551; 6 to 46 tokens, the longest included). The full set passes
    as well but costs 2-5 s more per case on the shared 2-core machine, over this file's time budget."""
    case, checkpoint, export = exported
    sentences = stsb_test_sentences[::8]
    loader = _loader(export.folder)
    model, tokenizer, spec = loader.load_prefix_encoder(export.folder)
    got = loader.embed_sentences(model, tokenizer, spec, sentences, batch_size=256)
    want = reference_embeddings(load_checkpoint(checkpoint), sentences, batch_size=256)
    assert got.shape == want.shape == (319, D)
    assert float((got - want).abs().max()) <= TOLERANCE
    assert export.exact and export.max_abs_diff <= TOLERANCE
    # the adapter carries what matters: the bare base gives other vectors (PeftModel.disable_adapter() fails on an
    # encoder-only prompt-learning model in peft 0.21.2: it patches prepare_inputs_for_generation, which BertModel lacks)
    from transformers import AutoModel

    bare = AutoModel.from_pretrained(loader.base_model_path(export.folder)).eval()
    enc = tokenizer(loader.model_inputs(spec, sentences[:64]), padding=True, return_tensors="pt")
    with torch.inference_mode():
        plain = loader.pool(
            spec,
            bare(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]),
            enc["input_ids"],
            enc["attention_mask"],
        )
    assert float((plain - want[:64]).abs().max()) > 1e-2


def test_the_folder_is_a_plain_peft_prefix_adapter(exported):
    from peft import PeftModel, PeftModelForFeatureExtraction
    from transformers import AutoModel

    case, checkpoint, export = exported
    _, cls, overrides, pooling, modules = CASES[case]
    config = json.loads((export.folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"]) == ("PREFIX_TUNING", "FEATURE_EXTRACTION")
    assert config["prefix_projection"] is False  # a reparametrised prefix is stored as its output rows
    prefix_len = overrides.get("prefix_len", 16)
    shape = (config["num_virtual_tokens"], config["num_layers"], config["token_dim"], config["num_attention_heads"])
    assert shape == (prefix_len, 2, D, 4)
    assert (config["modules_to_save"] or []) == modules == export.modules_to_save
    assert config["base_model_name_or_path"] == export.base_model
    tensors = load_file(export.folder / "adapter_model.safetensors")
    assert tensors["prompt_embeddings"].shape == (prefix_len, 2 * 2 * D)
    assert all(any(m in k for m in modules) for k in tensors if k != "prompt_embeddings")
    peft_files = ("adapter_config.json", "adapter_model.safetensors")
    assert export.adapter_bytes == sum((export.folder / f).stat().st_size for f in peft_files)
    assert export.pooling["kind"] == pooling
    bundled = export.folder / "base_model"
    assert bundled.is_dir() == (cls is DiffAug) and ("fine-tuned-base" in export.limitation_codes) == (cls is DiffAug)
    # the stock call of the brief, without our loader
    base = AutoModel.from_pretrained(str(bundled) if bundled.is_dir() else export.base_model)
    assert isinstance(PeftModel.from_pretrained(base, str(export.folder)), PeftModelForFeatureExtraction)
    # notes: machine-readable in cse_peft.json and listed in the job's model card (the export writes no README)
    spec = json.loads((export.folder / "cse_peft.json").read_text())
    assert (spec["exact"], spec["limitations"], spec["pooling"]) == (True, export.limitations, export.pooling)
    card = _card(export.folder)
    assert "It reproduces this model's embeddings within 1e-5" in card and not (export.folder / "README.md").exists()
    assert all(f"- {code}: " in card for code in export.limitation_codes)  # (a card names no absolute path)
    assert {"inference-only", "token-type-ids", "sentence-transformers"} <= set(export.limitation_codes)


def test_the_loader_uses_only_transformers_and_peft(exported):
    _, _, export = exported
    source = (export.folder / LOADER_FILE).read_text()
    assert source == (Path(__file__).parents[2] / "models" / "export" / "peft_loader.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "json", "pathlib", "typing", "torch", "peft", "transformers"}


def test_sentence_transformers_refuses_prompt_adapters_and_the_wrap_route_works(exports, stsb_test_sentences):
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    case, checkpoint, export = exports("d2cse-bert-cls-prompt")
    note = export.limitations[export.limitation_codes.index("sentence-transformers")]
    assert "wrap the Transformer module's model" in note
    base = export.base_model
    st = SentenceTransformer(modules=[Transformer(base), Pooling(D, "cls")], device="cpu")
    with pytest.raises(ValueError, match="prompt learning"):
        st.load_adapter(str(export.folder))
    st = SentenceTransformer(modules=[Transformer(base), Pooling(D, "cls")], device="cpu")
    st[0].model = PeftModel.from_pretrained(st[0].model, str(export.folder)).eval()
    sentences = stsb_test_sentences[::40]  # 64
    with pytest.warns(UserWarning, match="[Tt]oken type ids"):  # ST passes them, PEFT drops them (all zero here)
        got = st.encode(sentences, convert_to_tensor=True, batch_size=64)
    want = reference_embeddings(load_checkpoint(checkpoint), sentences)
    assert float((got - want).abs().max()) <= TOLERANCE


def test_unshifted_positions_are_refused_or_marked_inexact(tiny_bert_dir, tmp_path):
    checkpoint = _trained_checkpoint(DCPCSE, tiny_bert_dir, tmp_path / "best", prefix_len=4, shift_positions=False)
    out = tmp_path / "adapter"
    with pytest.raises(PeftExportError, match="position-shift"):
        export_peft_adapter(checkpoint, out)
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    export = export_peft_adapter(checkpoint, out, allow_inexact=True)
    assert not export.exact and export.max_abs_diff > TOLERANCE
    assert export.limitation_codes[:2] == ["position-shift", "verification"]
    assert json.loads((out / "cse_peft.json").read_text())["exact"] is False
    assert "does **not** reproduce this model's embeddings exactly" in _card(out)


def test_bad_sources_and_targets_are_refused(tiny_bert_dir, tmp_path):
    torch.manual_seed(0)
    simcse = save_checkpoint(SimCSE(SimCSEConfig(backbone=str(tiny_bert_dir))).eval(), tmp_path / "simcse")
    with pytest.raises(PeftExportError, match="no prompts"):
        export_peft_adapter(simcse, tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match="cse_model.json"):
        export_peft_adapter(tmp_path / "nothing", tmp_path / "adapter")
    checkpoint = _trained_checkpoint(D2CSE, tiny_bert_dir, tmp_path / "best", prefix_len=2)
    for target in (checkpoint, checkpoint.parent, checkpoint / "inside"):
        with pytest.raises(ValueError, match="overwrite the checkpoint"):
            export_peft_adapter(checkpoint, target)
    # a refused export leaves an earlier one in place; a new export replaces it
    out = export_peft_adapter(checkpoint, tmp_path / "adapter").folder
    (out / "stale.txt").write_text("x")
    with pytest.raises(PeftExportError):
        export_peft_adapter(simcse, out)
    assert (out / "stale.txt").is_file() and (out / "adapter_config.json").is_file()
    export_peft_adapter(checkpoint, out)
    assert not (out / "stale.txt").exists()


def test_a_backbone_without_a_cache_path_is_refused(tokenizer, tmp_path):
    """DistilBERT's attention takes no past_key_values, so no PEFT prefix can reach it (likewise MPNet, DeBERTa-v2 and
    ModernBERT in transformers 5.23): the export names the architecture instead of writing a useless adapter."""
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    backbone = tmp_path / "distilbert"
    DistilBertModel(
        DistilBertConfig(
            vocab_size=len(tokenizer), dim=D, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128
        )
    ).save_pretrained(backbone)
    tokenizer.save_pretrained(backbone)
    checkpoint = _trained_checkpoint(DCPCSE, backbone, tmp_path / "best", prefix_len=2)
    with pytest.raises(PeftExportError, match="DistilBertModel: its forward takes no past_key_values"):
        export_peft_adapter(checkpoint, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def _card(folder: Path) -> str:
    """The model card's text for an adapter folder alone (cse.tracking.model_card reads its `cse_peft.json`)."""
    from cse.tracking.model_card import AdapterInfo, CardFacts, model_card

    adapter = AdapterInfo.from_folder(folder)
    return model_card(
        CardFacts(method="d2cse", method_title="D2CSE", preset="t", backbone="tiny", setting="unsup", adapter=adapter)
    )
