"""Issue 32, Numbers: a model that embeds sentences as `nan` is never scored, registered or exported silently.

The campaign's case: a backbone whose embedding row of one token is `inf`, a token the training rows never hold. It
trained, registered and exported; 115 of 18,850 STS test pairs had NaN embeddings, which the cosine turned into 0
without a word. Now the job refuses the backbone before its first step, and an evaluation refuses non-finite
embeddings (naming how many and the first sentences) instead of scoring them. New cases of the class: the transfer
tasks' embedding pass and a bare `cosine_pairs` call refuse them too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from cse.evaluation.encode import NonFiniteEmbeddings, embed_sentences
from cse.evaluation.evaluator import Evaluator
from cse.evaluation.sts import cosine_pairs
from cse.models.embedder import PooledEncoder
from cse.training.job import NonFiniteWeights

pytestmark = pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs:UserWarning")


def _sts_table(data_root):
    _, refs = data_root
    return pq.read_table(sorted(Path(refs["sts"].path).glob("part-*.parquet")))


@pytest.fixture(scope="module")
def inf_backbone(data_root, tiny_bert_dir, tmp_path_factory):
    """The tiny BERT with the embedding row of one token set to `inf`: the STS-B test sentences' most frequent token
    that no training row holds. Returns (folder, token)."""
    from transformers import AutoTokenizer, BertModel

    folder, refs = data_root
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    trained = {
        t
        for part in Path(refs["tokens"].path).glob("part-*.parquet")
        for ids in pq.read_table(part, columns=["input_ids"]).column(0).to_pylist()
        for t in ids
    }
    sts = _sts_table(data_root).to_pandas()
    counts: dict[int, int] = {}
    for s in sts[sts.task == "stsb"].sentence1:
        for t in tok(s, add_special_tokens=False)["input_ids"]:
            if t not in trained:
                counts[t] = counts.get(t, 0) + 1
    token = max(counts, key=counts.get)
    model = BertModel.from_pretrained(tiny_bert_dir)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[token] = float("inf")
    out = tmp_path_factory.mktemp("inf_backbone")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, token


def test_an_evaluation_refuses_nan_embeddings_instead_of_scoring_them_0(data_root, inf_backbone):
    folder, token = inf_backbone
    encoder = PooledEncoder.from_pretrained(str(folder), "avg")
    with pytest.raises(NonFiniteEmbeddings, match=r"\d+ of [\d,]+ sentences of evaluate \(test\) have non-finite") as e:
        Evaluator(_sts_table(data_root)).run(encoder, "test", extras=False)
    assert 0 < len(e.value.rows) < e.value.total and "not scored as cosine 0" in str(e.value)
    assert "#" in str(e.value)  # the first sentences are quoted with their index


def test_a_job_refuses_a_backbone_with_non_finite_weights_before_its_first_step(job, inf_backbone):
    import mlflow

    folder, token = inf_backbone
    with pytest.raises(NonFiniteWeights, match=rf"word_embeddings.weight \(32 of [\d,]+ values, rows {token}\)"):
        job(backbone=str(folder))
    [run] = mlflow.search_runs(
        experiment_names=["simcse"], output_format="list", max_results=1, order_by=["attributes.start_time DESC"]
    )
    assert (
        run.info.status == "FAILED" and mlflow.MlflowClient().search_model_versions(f"run_id='{run.info.run_id}'") == []
    )


def test_the_transfer_pass_and_a_bare_cosine_refuse_them_too(inf_backbone):
    folder, token = inf_backbone
    encoder = PooledEncoder.from_pretrained(str(folder), "cls")
    word = encoder.tokenizer.convert_ids_to_tokens(token)
    with pytest.raises(NonFiniteEmbeddings, match=rf"1 of 2 sentences .*#1 'a {word} here'"):
        embed_sentences(encoder, ["a plain sentence", f"a {word} here"], desc="evaluate (transfer)")
    a = np.ones((3, 4))
    b = a.copy()
    b[1, 2] = np.nan
    with pytest.raises(ValueError, match="1 of 3 pairs hold a non-finite"):
        cosine_pairs(a, b)
    assert cosine_pairs(a, np.zeros((3, 4))).tolist() == [0.0, 0.0, 0.0]  # a zero vector stays SentEval's 0
