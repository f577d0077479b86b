"""SentEval transfer tasks: the readers on the real files, the classifier against a plain PyTorch fit, the protocol on
synthetic tasks with a known answer, and one end-to-end transfer evaluation of a tiny model on a subset."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from cse.evaluation.classifier import FASTTEST, TEST, ClassifierSettings, fit_groups, group, initial_weights
from cse.evaluation.transfer import TransferEvaluator, score_features
from cse.storage.readers import DataFormatError
from cse.storage.transfer import EXPECTED_COUNTS, TRANSFER, CountMismatchError, read_transfer
from tests.loops import heads_ingest

# ---------------------------------------------------------------- readers (real files)


@pytest.fixture(scope="module")
def transfer_df(shared_data):
    table, stats = read_transfer(shared_data / "senteval")
    assert table.schema.equals(TRANSFER)
    return table.to_pandas(), stats


def test_transfer_counts_match_senteval(transfer_df):
    df, stats = transfer_df
    assert df.groupby(["task", "split"]).size().to_dict() == EXPECTED_COUNTS
    assert EXPECTED_COUNTS[("mr", "all")] == 10_662 and EXPECTED_COUNTS[("mrpc", "test")] == 1_725
    labels = df.groupby(["task", "split"]).label.value_counts().to_dict()
    assert labels[("mr", "all", 1)] == labels[("mr", "all", 0)] == 5331
    assert (labels[("cr", "all", 1)], labels[("cr", "all", 0)]) == (2407, 1368)  # blank lines counted, as SentEval's N
    assert (labels[("mpqa", "all", 1)], labels[("mpqa", "all", 0)]) == (3312, 7294)
    assert (labels[("subj", "all", 1)], labels[("subj", "all", 0)]) == (5000, 5000)  # objective = 1
    assert sorted(df[df.task == "trec"].label.unique()) == [0, 1, 2, 3, 4, 5]
    assert (labels[("mrpc", "train", 1)], labels[("mrpc", "train", 0)]) == (2753, 1323)


def test_transfer_reading_rules(transfer_df):
    df, stats = transfer_df
    blank = df[df.sentence1 == ""]
    assert sorted(zip(blank.file, blank.line)) == [
        ("CR/custrev.neg", 769),
        ("CR/custrev.neg", 1368),
        ("CR/custrev.pos", 2323),
        ("CR/custrev.pos", 2407),
        ("MPQA/mpqa.neg", 6415),
        ("MPQA/mpqa.neg", 7294),
        ("MPQA/mpqa.pos", 3312),
    ]
    assert stats.empty == 7
    mrpc = df[df.task == "mrpc"]
    assert mrpc.sentence2.notna().all() and df[df.task != "mrpc"].sentence2.isna().all()
    first = mrpc[(mrpc.split == "train") & (mrpc.example_index == 0)].iloc[0]
    assert first.line == 2 and first.label == 1  # header + BOM skipped
    assert first.sentence1.startswith("Amrozi accused his brother")
    assert not df.sentence1.str.contains("\ufeff").any()
    trec = df[(df.task == "trec") & (df.split == "test")].iloc[0]
    assert trec.sentence1 == "How far is it from Denver to Aspen ?" and trec.label == 5  # NUM:dist → NUM
    assert df[df.task == "sst2"].sentence1.str.contains("é").any()  # SST is UTF-8 (SentEval reads it so)
    assert df[df.task == "trec"].sentence1.str.contains("ð").any()  # TREC is latin-1
    assert not df.sentence1.str.contains(r"\s\s|\t").any()


def _downstream(tmp_path, **override):
    files = {
        "MR/rt-polarity.pos": "good film .\n",
        "MR/rt-polarity.neg": "bad film .\n",
        "CR/custrev.pos": "nice\n\n",
        "CR/custrev.neg": "awful\n",
        "SUBJ/subj.objective": "a fact .\n",
        "SUBJ/subj.subjective": "i feel .\n",
        "MPQA/mpqa.pos": "happy\n",
        "MPQA/mpqa.neg": "sad\n",
        "SST/binary/sentiment-train": "fine \t1\n",
        "SST/binary/sentiment-dev": "meh \t0\n",
        "SST/binary/sentiment-test": "ok \t1\n",
        "TREC/train_5500.label": "NUM:dist How far ?\n",
        "TREC/TREC_10.label": "HUM:ind Who ?\n",
        "MRPC/msr_paraphrase_train.txt": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\ta b\ta  b\n",
        "MRPC/msr_paraphrase_test.txt": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t3\t4\tc\td\n",
    } | override
    for name, text in files.items():
        p = tmp_path / "downstream" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return tmp_path


def test_transfer_reader_errors_name_file_and_line(tmp_path):
    table, _ = read_transfer(_downstream(tmp_path), check_counts=False)
    assert table.num_rows == 16 and table.column("sentence2").to_pylist()[-2:] == ["a b", "d"]
    with pytest.raises(CountMismatchError, match="mr/all"):
        read_transfer(tmp_path)
    with pytest.raises(DataFormatError, match=r"TREC_10\.label:2: coarse label 'XYZ'"):
        read_transfer(
            _downstream(tmp_path, **{"TREC/TREC_10.label": "HUM:ind Who ?\nXYZ:a What ?\n"}), check_counts=False
        )
    with pytest.raises(DataFormatError, match=r"sentiment-dev:1: 1 tab-separated fields"):
        read_transfer(_downstream(tmp_path, **{"SST/binary/sentiment-dev": "no label here\n"}), check_counts=False)
    with pytest.raises(DataFormatError, match=r"msr_paraphrase_test\.txt:2: 3 tab-separated fields"):
        read_transfer(
            _downstream(tmp_path, **{"MRPC/msr_paraphrase_test.txt": "Quality\t#1\t#2\t#1 S\t#2 S\n0\tx\ty\n"}),
            check_counts=False,
        )


# ---------------------------------------------------------------- the classifier


def _reference_fit(x, y, train, valid, reg, s: ClassifierSettings):
    """SentEval's MLP(nhid=0).fit written plainly with torch.optim (global seeds, one model)."""
    with torch.random.fork_rng():
        np.random.seed(s.seed)
        torch.manual_seed(s.seed)
        model = torch.nn.Linear(x.shape[1], 2)
        opt = (torch.optim.Adam if s.optim == "adam" else torch.optim.RMSprop)(model.parameters())
        opt.param_groups[0]["weight_decay"] = reg
        tx, ty, vx, vy = x[train], y[train], x[valid], y[valid]
        epochs, best, count, stop, best_model = 0, -1.0, 0, False, None
        while not stop and epochs <= s.max_epoch:
            for _ in range(s.epoch_size):
                perm = np.random.permutation(len(tx))
                for i in range(0, len(tx), s.batch_size):
                    idx = torch.from_numpy(perm[i : i + s.batch_size])
                    loss = torch.nn.functional.cross_entropy(model(tx[idx]), ty[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            epochs += s.epoch_size
            with torch.no_grad():
                acc = float((model(vx).argmax(1) == vy).float().mean())
            if acc > best:
                best, best_model = acc, copy.deepcopy(model)
            else:
                if count >= s.tenacity:
                    stop = True
                count += 1
    return best, best_model, epochs


def test_batched_classifier_equals_a_plain_pytorch_fit():
    rs = np.random.RandomState(0)
    x = torch.from_numpy(rs.randn(330, 12).astype(np.float32))
    y = torch.from_numpy((((x.numpy() @ rs.randn(12)) > 0) ^ (rs.rand(330) < 0.15)).astype(np.int64))
    train, valid = np.arange(0, 270), np.arange(270, 330)
    with torch.random.fork_rng():
        torch.manual_seed(1111)
        lin = torch.nn.Linear(12, 2)
    w0, b0 = initial_weights(12, 2, 1111)
    assert torch.equal(lin.weight.t(), w0) and torch.equal(lin.bias, b0)
    for s in (dataclasses.replace(TEST, max_epoch=40), FASTTEST):
        regs = (1e-5, 1e-2)
        fits = fit_groups(
            x, y, 2, [group(train, regs, s.seed, valid=valid), group(train[:200], regs, s.seed, valid=valid)], s
        )
        assert [f.reg for f in fits[0]] == list(regs)
        for rows, group_fits in ((train, fits[0]), (train[:200], fits[1])):  # two sizes in one batch: padded steps
            for r, f in zip(regs, group_fits):
                acc, model, epochs = _reference_fit(x, y, rows, valid, r, s)
                assert f.valid_accuracy == pytest.approx(acc, abs=1e-6) and f.epochs == epochs
                torch.testing.assert_close(f.weight, model.weight.detach().t(), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the protocol on synthetic tasks

FAST = ClassifierSettings(optim="rmsprop", batch_size=64, tenacity=2, epoch_size=2, kfold=3, max_epoch=20)


def _synthetic(n: int, d: int, classes: int, seed: int, shuffle: bool):
    rs = np.random.RandomState(seed)
    y = rs.randint(0, classes, n)
    x = rs.randn(n, d).astype(np.float32) * 0.3
    x[np.arange(n), y] += 3.0  # class c lives along axis c: linearly separable with a margin
    if shuffle:
        y = rs.permutation(y)
    return torch.from_numpy(x), y


@pytest.mark.parametrize("task", ["mr", "sst2", "trec", "mrpc"])
def test_protocol_separable_reaches_100_and_shuffled_stays_near_chance(task):
    classes = 6 if task == "trec" else 2
    splits = {"mr": ("all",), "sst2": ("train", "dev", "test"), "trec": ("train", "test"), "mrpc": ("train", "test")}[
        task
    ]
    for shuffle in (False, True):
        feats, labels = {}, {}
        for i, sp in enumerate(splits):
            feats[sp], labels[sp] = _synthetic(300, 8, classes, seed=10 * i + int(shuffle), shuffle=shuffle)
        score = score_features(task, feats, labels, FAST, chunk=16)
        chance = 100.0 / classes
        if not shuffle:
            assert score.acc == 100.0 and score.devacc == 100.0
            assert score.f1 == (100.0 if task == "mrpc" else None)  # F1 of the paraphrase class, MRPC only
        else:
            assert abs(score.acc - chance) < 15, score
            assert (score.f1 is None) == (task != "mrpc")
        assert score.regs and all(r in FAST.regs for r in score.regs)


# ---------------------------------------------------------------- end to end (tiny model, subset)


def test_transfer_evaluation_end_to_end(shared_data, tiny_bert_dir, isolated_home):
    import mlflow

    from cse.config.evaluation import EvalConfig
    from cse.storage.catalog import query
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings
    from cse.tasks.evaluate import run_evaluation

    cfg = EvalConfig(
        model=str(tiny_bert_dir),
        pooler="avg",
        mode="transfer",
        transfer_limit=40,
        transfer_classifier="fasttest",
        progress=False,
    )
    summary = run_evaluation(cfg)
    assert summary.mode == "transfer"
    for t in ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc", "transfer_avg"):
        assert 0.0 <= summary.metrics[t] <= 100.0
        assert summary.metrics[t] == round(summary.metrics[t], 2)
    assert "| MR | CR | SUBJ | MPQA | SST | TREC | MRPC | Avg. |" in summary.table_row
    run = mlflow.get_run(summary.mlflow_run_id)
    assert run.data.metrics["transfer_avg"] == summary.metrics["transfer_avg"] and "mrpc_f1" in run.data.metrics
    [used] = run.inputs.dataset_inputs  # the SentEval folder it read, with its rows and content hash
    assert used.dataset.name == "transfer-source/downstream" and json.loads(used.dataset.profile)["num_rows"] > 0
    assert run.data.tags["transfer_hash"].startswith(used.dataset.digest)
    rows = query(DataRoot(get_settings().data_root), "SELECT mode, mr, transfer_avg, stsb FROM evaluations")
    assert rows.iloc[0]["mode"] == "transfer" and rows.iloc[0]["transfer_avg"] == summary.metrics["transfer_avg"]
    assert rows.iloc[0]["stsb"] is None or np.isnan(rows.iloc[0]["stsb"])


def test_every_unique_sentence_is_embedded_once(shared_data):
    table, _ = read_transfer(shared_data / "senteval", tasks=("trec", "mrpc"))
    ev = TransferEvaluator(table)
    sentences = ev.sentences(["trec", "mrpc"])
    df = table.to_pandas()
    expected = set(df.sentence1) | set(df.sentence2.dropna())
    assert len(sentences) == len(set(sentences)) == len(expected) < len(df) + df.sentence2.notna().sum()


def test_transfer_config_presets_and_comparison():
    from cse.config.evaluation import EvalConfig
    from cse.config.published import TRANSFER, published_keys
    from cse.config.training import resolve_train_config
    from cse.tasks.compare import RunRecord, build_comparison

    with pytest.raises(ValueError, match="transfer_tasks"):
        EvalConfig(model="m", pooler="avg", mode="transfer", tasks=("stsb",))
    bert = resolve_train_config("transfer", method="diffcse")
    rob = resolve_train_config("transfer-roberta-base", method="diffcse")
    assert (bert.learning_rate, bert.corrupt.mask_ratio, bert.model.rtd_weight) == (2e-6, 0.15, 0.05)
    assert (bert.batch_size, bert.epochs) == (64, 2)
    assert (rob.learning_rate, rob.corrupt.mask_ratio, rob.model.rtd_weight) == (3e-6, 0.15, 0.05)
    assert (rob.batch_size, rob.backbone) == (128, "roberta-base")
    assert bert.transfer_evaluation and bert.selection == "stsb"
    assert resolve_train_config("transfer", {"selection": "transfer"}, method="diffcse").selection == "transfer"
    assert not any(k[0] == "simcse-mlm" for k in published_keys())  # transfer rows stay outside the preset mapping
    assert TRANSFER[("diffcse", "bert-base", "unsup")]["transfer_avg"] == 86.86
    run = RunRecord(
        run_id="r1",
        label="diffcse-transfer",
        method="diffcse",
        backbone="bert-base-uncased",
        preset="transfer",
        supervised=False,
        metrics={
            "sts_avg": 78.0,
            "mr": 82.0,
            "cr": 87.0,
            "subj": 95.0,
            "mpqa": 89.0,
            "sst2": 86.0,
            "trec": 90.0,
            "mrpc": 76.0,
            "transfer_avg": 86.43,
        },
    )
    rows = [r for r in build_comparison([run]) if r["table"] == "transfer"]
    assert {r["row_kind"] for r in rows} == {"run", "published", "difference"}
    diff = {r["metric"]: r["value"] for r in rows if r["row_kind"] == "difference"}
    assert diff["transfer_avg"] == pytest.approx(86.43 - 86.86)


@pytest.mark.slow  # a training flow under the Prefect harness
def test_training_selects_on_the_transfer_dev_average(
    prefect_harness, tiny_bert_dir, shared_data, wiki_head, senteval_head, monkeypatch
):
    """selection: transfer logs transfer_dev_avg every eval step, keeps the best one and test-evaluates on the transfer
    tasks too (a subset of the data through `cse.training.job.transfer_evaluator`, to stay cheap; the Wiki1M and STS
    inputs are the heads of the shared files, `wiki_head` and `senteval_head`, for the same reason)."""
    import cse.training.job as train_task
    from cse.flows.train import TRAIN_FLOWS
    from cse.storage.transfer import load_transfer_input
    from cse.tracking.store import configure_mlflow

    def small(data_root):
        source = load_transfer_input(str(shared_data / "senteval"), None)
        return TransferEvaluator(source.table, limit=120), source

    monkeypatch.setattr(train_task, "transfer_evaluator", small)
    overrides = {
        "backbone": str(tiny_bert_dir),
        "max_steps": 2,
        "eval_steps": 1,
        "log_steps": 1,
        "max_train_sentences": 64,
        "selection": "transfer",
        "ingest": heads_ingest(wiki_head, senteval_head),
    }
    result = TRAIN_FLOWS["simcse"]("smoke", overrides)
    configure_mlflow()
    import mlflow

    client = mlflow.tracking.MlflowClient()
    history = [m.value for m in client.get_metric_history(result.run_id, "dev/transfer_dev_avg")]
    assert len(history) == 2 and result.best_stsb_dev == max(history)  # the selection score is the transfer dev average
    assert len(client.get_metric_history(result.run_id, "dev/stsb_dev")) == 2  # still logged beside it
    metrics = client.get_run(result.run_id).data.metrics
    assert {"mr", "sst2", "mrpc", "transfer_avg", "sts_avg"} <= set(metrics) and "transfer_avg" in result.test_metrics


def test_ingest_transfer_dataset_then_cache_hit(prefect_harness, shared_data):
    from cse.config.stages import IngestConfig, SentEvalSource
    from cse.flows.ingest import ingest
    from cse.storage.catalog import query
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings
    from cse.storage.transfer import load_transfer_input

    cfg = IngestConfig(datasets=("transfer",), senteval=SentEvalSource(path=str(shared_data / "senteval")))
    first = ingest(cfg)["transfer"]
    assert first.rows == sum(EXPECTED_COUNTS.values()) == 116_838 and not first.cache_hit
    second = ingest(cfg)["transfer"]
    assert second.cache_hit and second.key == first.key
    root = DataRoot(get_settings().data_root)
    counts = query(root, "SELECT task, split, count(*) AS n FROM transfer GROUP BY ALL")
    assert {(r.task, r.split): r.n for r in counts.itertuples()} == EXPECTED_COUNTS
    loaded = load_transfer_input(first.key, root)
    assert loaded.origin == "dataset" and loaded.table.num_rows == 116_838
