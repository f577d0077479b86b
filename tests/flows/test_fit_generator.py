"""The fit-generator flow under a temporary Prefect server: ingest → tokenise (the backbone's tokenizer) → fit,
then a rerun that is a cache hit at every stage."""

from __future__ import annotations

import mlflow

from cse.config.stages import GeneratorConfig, IngestConfig, WikiSource
from cse.flows.fit_generator import fit_generator
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.tracking.store import configure_mlflow


def test_fit_generator_flow_tokenises_with_the_backbone_and_reuses_everything(prefect_harness, wiki_cut, tiny_bert_dir):
    ingest = IngestConfig(datasets=("wiki1m",), wiki=WikiSource(path=str(wiki_cut(200))))
    config = GeneratorConfig(
        backbone=str(tiny_bert_dir), batch_size=32, max_steps=6, eval_every=3, baseline_generator=None, device="cpu"
    )

    ref = fit_generator(config=config, ingest_config=ingest)
    assert ref.kind == "generator" and not ref.cache_hit
    root = DataRoot(get_settings().data_root)
    m = root.require("generator", ref.key)
    tokens = root.require("tokens", m.source["tokens_key"])
    assert tokens.params["tokenizer"] == str(tiny_bert_dir) and tokens.rows == 200
    assert m.stats["steps"] == 6 and set(m.stats["heldout_top1"]) == {"fitted", "unigram_argmax", "unigram_sample"}

    again = fit_generator(config=config, ingest_config=ingest)
    assert again.cache_hit and again.key == ref.key
    configure_mlflow()
    runs = mlflow.search_runs(experiment_names=["data"], output_format="list")
    by_name = sorted((r.info.run_name, r.data.metrics["cache_hit"]) for r in runs)
    assert [hit for name, hit in by_name if name == "fit-generator"] == [0.0, 1.0]
    assert all(r.info.status == "FINISHED" for r in runs)
