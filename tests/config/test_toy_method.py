"""A sixth method added the way docs/architecture.md's "Adding a method" says: its module and its presets, nothing
else: everything per method derives from its model class and its presets.

The toy method is deep prompts on a frozen encoder with the in-batch contrastive loss, defined in this file, which
the tests make the module `cse.models.methods.toy` (in `sys.modules`) while adding its presets to `PRESETS`. They
check that its registry entry, training config, stages, training flow (the entrypoint `cse.flows.train:train_toy`,
with no line in flows/train.py), its generated prefect.yaml entries and their deployment on a Prefect server, its
model card (title, summary, citation, published row), its PEFT adapter plan and its rows of the comparison all come
from those two places, with no other file naming it.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from cse.config import published
from cse.config.methods import REGISTRY, MethodSpec, get_method, missing_deployments
from cse.config.presets import PRESETS
from cse.config.training import preset_row, resolve_train_config
from cse.flows.train import TRAIN_FLOWS
from cse.models.batching import TrainBatch, pad_sequences
from cse.models.export.peft_export import PeftExportError, adapter_plan
from cse.models.losses import contrastive_loss
from cse.models.method import METHOD_CONFIG, CSEModel, Positive, PromptConfig, StepOutput, config_dataclass
from cse.models.prompts.backbone import PromptedModel
from cse.storage.settings import REPO_ROOT
from cse.tracking.model_card import CardFacts, model_card

TOY_BIBTEX = """@misc{toy2026,
  title  = {A Toy Method for the Registry Test},
  author = {Nobody, A.},
  year   = {2026}
}"""


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class ToyConfig(PromptConfig):
    """The toy's model fields: the prompts' (`PromptConfig`, with their checks) and a temperature."""

    temperature: Positive = 0.05


class ToyCSE(PromptedModel, CSEModel):
    """Deep prompts on a frozen encoder, two dropout views, the in-batch contrastive loss; `embed` is the CLS state."""

    method = "toy"
    title = "Toy"
    summary = "deep prompts on a frozen encoder, dropout views"
    config_class = ToyConfig
    evaluation_pooler = "cls_before_pooler"
    paper = "A. Nobody (2026). A Toy Method for the Registry Test."
    bibtex = TOY_BIBTEX
    builds_on = ("simcse",)

    def __init__(self, config: ToyConfig, backbone: nn.Module | None = None, tokenizer=None):
        super().__init__()
        self.attach_prompted_backbone(config, backbone, tokenizer)

    def embed(self, input_ids, attention_mask, token_type_ids=None):
        prefix = self.prompts(input_ids.shape[0])
        return self.encoder(input_ids, attention_mask, token_type_ids, prefix=prefix).last_hidden_state[:, 0]

    def training_step(self, batch: TrainBatch, step: int = 0, phase: str = "main") -> StepOutput:
        b, n, t = batch.input_ids.shape
        z = self.embed(batch.input_ids.view(b * n, t), batch.attention_mask.view(b * n, t)).view(b, n, -1)
        return StepOutput(contrastive_loss(z[:, 0], z[:, 1], temperature=self.config.temperature))

    def peft_plan(self, plan):
        plan.notes.append("toy: CLS pooling with the prompts on; nothing else to carry")
        return plan


TOY_PRESETS = {
    "default": {"backbone": "packaged:minilm", "learning_rate": 0.01, "model": {"prefix_len": 4}},
    "smoke": {"backbone": "packaged:minilm", "max_steps": 4, "eval_steps": 2, "model": {"prefix_len": 2}},
}


@pytest.fixture
def toy(monkeypatch) -> MethodSpec:
    """The toy method added as a new method is: this file as its module `cse.models.methods.toy`, and its presets."""
    monkeypatch.setitem(sys.modules, "cse.models.methods.toy", sys.modules[__name__])
    monkeypatch.setitem(PRESETS, "toy", TOY_PRESETS)
    return get_method("toy")


def test_the_registry_entry_gives_config_stages_and_the_aux_rule(toy):
    assert "toy" in REGISTRY and REGISTRY["toy"] is toy and list(REGISTRY)[-1] == "toy"
    assert toy.model_class is ToyCSE and toy.config_class is ToyConfig and toy.title == "Toy"
    cfg = resolve_train_config("default", {"model": {"temperature": 0.1}}, method="toy")
    assert cfg.model == ToyConfig(backbone="packaged:minilm", prefix_len=4, temperature=0.1)
    assert cfg.model_dump(mode="json")["model"]["prefix_len"] == 4 and not cfg.uses_corruption
    assert toy.stages(supervised=False) == ("ingest:wiki1m", "tokenize:wiki1m", "train", "evaluate")
    assert toy.phases == ("main",) and not toy.accepts_aux_nli and not toy.ablations
    with pytest.raises(ValueError, match=r"method toy takes no auxiliary NLI batch \(methods that do: \['diffaug'\]\)"):
        resolve_train_config("default", {"aux_nli_batch_size": 8}, method="toy")
    with pytest.raises(ValueError, match="unknown ToyConfig keys"):
        resolve_train_config("default", {"model": {"rtd_weight": 0.1}}, method="toy")
    assert preset_row("toy", "default") == ("toy", None, "unsup")


def test_the_training_flow_and_the_deployments_it_needs(toy, capsys):
    """The flow comes from the registry entry (no line in flows/train.py); the deployment check prints the
    prefect.yaml lines to add, and `cse prefect-yaml` would write them."""
    from cse.flows import train
    from cse.ops.deployments import generated_prefect_yaml

    flow = TRAIN_FLOWS["toy"]
    assert train.train_toy is flow and "train_toy = " not in Path(train.__file__).read_text()
    assert flow.__name__ == toy.flow_function
    assert flow.name == toy.flow_name == "train-toy" and toy.flow_function == "train_toy"
    assert toy.entrypoint == "cse.flows.train:train_toy" and toy.deployment("smoke") == "train-toy/smoke"
    assert "deep prompts on a frozen encoder" in flow.description

    text = (REPO_ROOT / "prefect.yaml").read_text()
    deployments = yaml.safe_load(text)["deployments"]
    lines = missing_deployments(toy, deployments)
    print(f"prefect.yaml lines to add for the toy method:\n{lines}")
    assert "prefect.yaml lines to add" in capsys.readouterr().out
    entries = yaml.safe_load("pool: &local_pool {name: local}\ndeployments:\n" + lines)["deployments"]
    assert [(e["name"], e["entrypoint"], e["parameters"]) for e in entries] == [
        ("default", "cse.flows.train:train_toy", {"preset": "default"}),
        ("smoke", "cse.flows.train:train_toy", {"preset": "smoke"}),
    ]
    assert entries[1]["tags"] == ["train", "toy", "smoke"] and entries[0]["work_pool"] == {"name": "local"}
    accepted = set(inspect.signature(flow.fn).parameters)
    assert all(set(e["parameters"]) <= accepted for e in entries)
    assert missing_deployments(toy, deployments + entries) == ""  # once added, nothing is missing
    generated = yaml.safe_load(generated_prefect_yaml(text))["deployments"]
    written = [e for e in generated if e["entrypoint"] == toy.entrypoint]  # what `cse prefect-yaml` writes
    assert [{**e, "work_pool": "*local_pool"} for e in written] == [{**e, "work_pool": "*local_pool"} for e in entries]
    assert written[0]["work_pool"]["name"] == "local"


def test_the_toy_is_deployed_from_its_generated_entries(toy, prefect_harness):
    """Each generated toy entry loads its flow the way `prefect deploy` and a worker do (the entrypoint, imported)
    and is registered on a Prefect server under its name, parameters and entrypoint."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import RunnerDeployment
    from prefect.flows import load_flow_from_entrypoint

    from cse.ops.deployments import generated_prefect_yaml

    text = generated_prefect_yaml((REPO_ROOT / "prefect.yaml").read_text())
    entries = [e for e in yaml.safe_load(text)["deployments"] if e["entrypoint"] == toy.entrypoint]
    assert [e["name"] for e in entries] == list(TOY_PRESETS)
    with get_client(sync_client=True) as client:
        for entry in entries:
            flow = load_flow_from_entrypoint(entry["entrypoint"], use_placeholder_flow=False)
            assert flow is TRAIN_FLOWS["toy"]
            RunnerDeployment.from_entrypoint(  # as `prefect deploy` reads the entry
                entry["entrypoint"],
                name=entry["name"],
                parameters=entry["parameters"],
                tags=entry["tags"],
                description=entry["description"],
            ).apply()
            deployed = client.read_deployment_by_name(toy.deployment(entry["name"]))
            assert deployed.entrypoint == toy.entrypoint and deployed.parameters == {"preset": entry["name"]}
            assert deployed.tags == entry["tags"] and deployed.description == entry["description"]
            assert set(deployed.parameter_openapi_schema["properties"]) >= {"preset", "overrides"}


def test_the_model_card_cites_the_toy_paper_and_its_published_row(toy, monkeypatch):
    cfg = resolve_train_config("default", method="toy")
    card = model_card(CardFacts.from_training(cfg, {"sts12": 70.0, "sts_avg": 75.0}))
    assert card.startswith("---\n") and "- toy\n" in card.split("---")[1]  # a front-matter tag
    assert (
        "# Toy · packaged:minilm · unsup" in card and "trained with **Toy**: deep prompts on a frozen encoder" in card
    )
    bib = card.split("```bibtex\n", 1)[1]
    assert bib.index(TOY_BIBTEX) < bib.index(get_method("simcse").bibtex) and "Please cite Toy, SimCSE" in card
    assert get_method("d2cse").bibtex not in card and "there is no published row" in card

    row = {"source": "Toy paper", **{t: 70.0 for t in published.STS[("simcse", "bert-base", "unsup")] if t != "source"}}
    monkeypatch.setitem(published.STS, ("toy", "bert-base", "unsup"), row)
    assert toy.published.sts == {("bert-base", "unsup"): row}
    card = model_card(
        CardFacts.from_training(
            resolve_train_config("default", {"backbone": "bert-base-uncased"}, method="toy"), {"sts12": 71.5}
        )
    )
    assert "Published row reproduced: `toy` / `bert-base` / `unsup`" in card and "| published (Toy paper) |" in card
    assert "| difference | +1.50 |" in card


def test_an_unknown_method_is_cited_as_nothing():
    card = model_card(
        CardFacts(method="nobody", method_title="Nobody", preset="default", backbone="x", setting="unsup")
    )
    assert "No paper is recorded for `nobody`" in card and "```bibtex" not in card
    assert get_method("simcse").bibtex not in card


def test_the_peft_plan_is_the_model_classs(toy, tiny_bert_dir):
    class ToyWithoutAdapter(ToyCSE):
        """The same model with no PEFT plan of its own (the base default: no adapter)."""

        peft_plan = CSEModel.peft_plan

    assert toy.exports_peft_adapter and ToyCSE.exports_peft_adapter and not ToyWithoutAdapter.exports_peft_adapter
    torch.manual_seed(0)
    model = toy.build_model(toy.model_config(str(tiny_bert_dir), {"prefix_len": 2}))
    plan = adapter_plan(model)
    assert plan.pooling == {"kind": "cls"} and plan.notes[-1].startswith("toy: ") and not plan.inexact
    assert [n.split(":")[0] for n in plan.notes] == ["inference-only", "token-type-ids", "toy"]
    with pytest.raises(PeftExportError, match="method 'toy' has no prompts to export"):
        adapter_plan(ToyWithoutAdapter(model.config, backbone=model.backbone, tokenizer=model.tokenizer))

    ids, mask = pad_sequences(model.token_ids(["a toy sentence", "another one"]), model.pad_token_id)
    batch = TrainBatch(torch.stack([ids, ids], 1), torch.stack([mask, mask], 1))
    out = model.train().training_step(batch)  # one forward of the toy's own loss
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.prompts.rows().requires_grad is True
    assert [p for p in model.phase_parameters("main")] == [p for p in model.prompts.parameters()]


def test_the_comparison_rows_derive_from_the_published_table(toy, monkeypatch):
    from cse.tasks.compare import RunRecord, build_comparison

    run = RunRecord(
        run_id="r1",
        label="toy-default",
        method="toy",
        backbone="bert-base-uncased",
        preset="default",
        supervised=False,
        metrics={"sts12": 71.0, "sts_avg": 76.0},
    )
    rows = build_comparison([run])
    assert {r["row_kind"] for r in rows} == {"run"} and {r["setting"] for r in rows} == {"unsup"}
    monkeypatch.setitem(
        published.STS, ("toy", "bert-base", "unsup"), {"source": "Toy paper", "sts12": 70.0, "sts_avg": 75.0}
    )
    rows = build_comparison([run])
    diff = {r["metric"]: r["value"] for r in rows if r["row_kind"] == "difference" and r["table"] == "sts"}
    assert diff["sts12"] == 1.0 and diff["sts_avg"] == 1.0
    assert {r["source"] for r in rows if r["row_kind"] == "published"} == {"Toy paper"}
