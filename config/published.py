"""Published numbers of the four papers (their tables), for side-by-side comparison with our runs.

STS: Spearman ×100, STS12–16 "all", STS-B / SICK-R test, Avg. over the seven. Keys: (method, backbone, setting)
with backbone `bert-base` / `bert-large` / `roberta-base` / `roberta-large` and setting `unsup` / `sup` /
`semi` / `semi-aux`. Where a paper re-ran another method, the original paper's row is the reference and the
re-run is kept under `reruns`. `rows_of(method)` (`MethodSpec.published`) gathers one method's rows; which
published row a preset reproduces is `cse.config.training.preset_row`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cse.storage.readers import SEVEN_TASKS


def _row(columns: tuple[str, ...], source: str, scores: tuple[float, ...]) -> dict[str, float | str]:
    """A published table row: one number per column (the tasks, then their average)."""
    if len(scores) != len(columns):
        raise ValueError(f"{source}: {len(columns) - 1} tasks + avg expected, got {len(scores)} numbers")
    return {"source": source, **dict(zip(columns, scores))}


def _sts(source: str, *scores: float) -> dict[str, float | str]:
    return _row((*SEVEN_TASKS, "sts_avg"), source, scores)


_BUILT, _DIFFAUG_3_RUNS = "D2CSE paper (built)", "DiffAug paper (3 runs)"
STS: dict[tuple[str, str, str], dict[str, float | str]] = {
    # unsupervised (Wiki1M)
    ("simcse", "bert-base", "unsup"): _sts("SimCSE paper", 68.40, 82.41, 74.38, 80.91, 78.56, 76.85, 72.23, 76.25),
    ("dcpcse", "bert-base", "unsup"): _sts("DCPCSE paper", 73.03, 85.18, 76.70, 84.19, 79.69, 80.62, 70.00, 78.49),
    ("diffcse", "bert-base", "unsup"): _sts("DiffCSE paper", 72.28, 84.43, 76.47, 83.90, 80.54, 80.59, 71.23, 78.49),
    ("d2cse", "bert-base", "unsup"): _sts("D2CSE paper", 73.42, 84.34, 77.43, 84.18, 81.16, 81.97, 70.61, 79.02),
    ("simcse", "bert-large", "unsup"): _sts("SimCSE paper", 70.88, 84.16, 76.43, 84.50, 79.76, 79.26, 73.88, 78.41),
    ("dcpcse", "bert-large", "unsup"): _sts("DCPCSE paper", 73.34, 85.90, 77.10, 85.26, 80.08, 80.96, 73.28, 79.42),
    ("d2cse", "bert-large", "unsup"): _sts("D2CSE paper", 74.56, 86.53, 77.61, 85.88, 80.64, 82.61, 72.11, 79.99),
    ("simcse", "roberta-base", "unsup"): _sts("SimCSE paper", 70.16, 81.77, 73.24, 81.36, 80.65, 80.22, 68.56, 76.57),
    ("dcpcse", "roberta-base", "unsup"): _sts("DCPCSE paper", 70.57, 81.91, 74.60, 82.90, 80.96, 82.84, 71.70, 77.93),
    ("diffcse", "roberta-base", "unsup"): _sts("DiffCSE paper", 70.05, 83.43, 75.49, 82.81, 82.12, 82.38, 71.19, 78.21),
    ("d2cse", "roberta-base", "unsup"): _sts("D2CSE paper", 70.53, 83.22, 75.61, 83.64, 82.53, 83.08, 72.54, 78.74),
    # supervised (NLI) and semi-supervised
    ("simcse", "bert-base", "sup"): _sts("SimCSE paper", 75.30, 84.67, 80.19, 85.40, 80.82, 84.25, 80.39, 81.57),
    ("dcpcse", "bert-base", "sup"): _sts("DCPCSE paper", 75.58, 84.33, 79.67, 85.79, 81.24, 84.25, 80.79, 81.65),
    ("diffcse", "bert-base", "sup"): _sts(_BUILT, 76.79, 82.41, 79.18, 85.77, 82.09, 83.91, 79.74, 81.41),
    ("d2cse", "bert-base", "sup"): _sts("D2CSE paper", 75.08, 84.34, 79.80, 86.35, 81.75, 83.93, 79.38, 81.52),
    ("diffaug", "bert-base", "sup"): _sts(_DIFFAUG_3_RUNS, 76.92, 85.17, 80.81, 86.91, 82.52, 84.32, 80.27, 82.42),
    ("simcse", "bert-large", "sup"): _sts("SimCSE paper", 75.78, 86.33, 80.44, 86.06, 80.86, 84.87, 81.14, 82.21),
    ("dcpcse", "bert-large", "sup"): _sts("DCPCSE paper", 77.97, 86.54, 81.04, 86.33, 81.81, 85.24, 81.31, 82.89),
    ("simcse", "roberta-base", "sup"): _sts("SimCSE paper", 76.53, 85.21, 80.95, 86.03, 82.57, 85.83, 80.50, 82.52),
    ("dcpcse", "roberta-base", "sup"): _sts("DCPCSE paper", 76.75, 85.86, 80.98, 86.51, 83.51, 86.58, 80.41, 82.94),
    ("diffcse", "roberta-base", "sup"): _sts(_BUILT, 76.37, 85.59, 80.65, 85.34, 83.44, 85.79, 77.99, 82.17),
    ("d2cse", "roberta-base", "sup"): _sts("D2CSE paper", 75.65, 87.26, 81.39, 86.31, 84.46, 86.17, 78.68, 82.85),
    ("simcse", "roberta-large", "sup"): _sts("SimCSE paper", 77.46, 87.27, 82.36, 86.66, 83.93, 86.70, 81.95, 83.76),
    ("dcpcse", "roberta-large", "sup"): _sts("DCPCSE paper", 79.14, 88.64, 83.73, 87.33, 84.57, 87.84, 82.07, 84.76),
    ("diffaug", "bert-base", "semi"): _sts(_DIFFAUG_3_RUNS, 75.28, 85.20, 78.57, 85.20, 81.01, 82.42, 73.24, 80.13),
    ("diffaug", "bert-base", "semi-aux"): _sts(_DIFFAUG_3_RUNS, 73.46, 85.61, 78.93, 85.82, 80.74, 82.70, 77.00, 80.61),
}

RERUNS: dict[tuple[str, str, str], dict[str, float | str]] = {
    ("simcse", "bert-base", "unsup"): _sts("DiffCSE re-run", 70.82, 82.24, 73.25, 81.38, 77.06, 77.24, 71.16, 76.16),
    ("simcse", "roberta-base", "unsup"): _sts("DiffCSE re-run", 68.60, 81.36, 73.16, 81.61, 80.76, 80.58, 68.83, 76.41),
    ("dcpcse", "bert-base", "sup"): _sts("D2CSE re-run", 74.45, 84.08, 79.06, 85.96, 81.12, 83.83, 80.47, 81.28),
    ("dcpcse", "roberta-base", "sup"): _sts("D2CSE re-run", 74.71, 85.96, 80.42, 86.13, 83.19, 85.76, 79.70, 82.27),
}


def _recall(source: str, ks: tuple[int, int, int], *scores: float) -> dict[str, float | str]:
    return _row(tuple(f"retrieval_r{k}" for k in ks), source, scores)


# retrieval on STS-B test (D2CSE paper: R@1/3/5; DiffCSE paper: R@1/5/10).
D2CSE_KS, DIFFCSE_KS = (1, 3, 5), (1, 5, 10)
RETRIEVAL: dict[tuple[str, str, str], dict[str, float | str]] = {
    ("dcpcse", "bert-base", "unsup"): _recall("D2CSE paper (re-trained)", D2CSE_KS, 90.21, 96.91, 98.97),
    ("diffcse", "bert-base", "unsup"): _recall("D2CSE paper (released)", D2CSE_KS, 89.69, 97.42, 98.97),
    ("d2cse", "bert-base", "unsup"): _recall("D2CSE paper", D2CSE_KS, 91.24, 96.91, 98.97),
    ("dcpcse", "bert-base", "sup"): _recall("D2CSE paper (re-trained)", D2CSE_KS, 92.78, 97.94, 98.45),
    ("diffcse", "bert-base", "sup"): _recall("D2CSE paper (built)", D2CSE_KS, 91.24, 97.42, 98.45),
    ("d2cse", "bert-base", "sup"): _recall("D2CSE paper", D2CSE_KS, 92.78, 98.45, 99.48),
    ("simcse", "bert-base", "unsup"): _recall("DiffCSE paper", DIFFCSE_KS, 77.84, 92.78, 95.88),
}

# alignment / uniformity on STS-B test (lower is better).
ALIGN_UNIFORM: dict[tuple[str, str, str], dict[str, float | str]] = {
    ("simcse", "bert-base", "unsup"): {"source": "DiffCSE paper", "alignment": 0.177, "uniformity": -2.313},
    ("dcpcse", "bert-base", "unsup"): {"source": "D2CSE paper", "alignment": 0.0842, "uniformity": -1.5074},
    ("diffcse", "bert-base", "unsup"): {"source": "D2CSE paper", "alignment": 0.0838, "uniformity": -1.4593},
    ("d2cse", "bert-base", "unsup"): {"source": "D2CSE paper", "alignment": 0.062, "uniformity": -1.2627},
    ("simcse", "bert-base", "sup"): {"source": "D2CSE paper", "alignment": 0.0898, "uniformity": -1.7635},
    ("dcpcse", "bert-base", "sup"): {"source": "D2CSE paper", "alignment": 0.0451, "uniformity": -1.4019},
    ("diffcse", "bert-base", "sup"): {"source": "D2CSE paper", "alignment": 0.0470, "uniformity": -1.2857},
    ("d2cse", "bert-base", "sup"): {"source": "D2CSE paper ([CLS] prompt)", "alignment": 0.0862, "uniformity": -2.1093},
}

# Trainable parameters at training time, BERT-base (from DCPCSE's prefix layout; papers quote rounded values).
PARAMETERS: dict[tuple[str, str], dict[str, float | str]] = {
    ("d2cse", "bert-base"): {
        "source": "computed from the prefix layout (DCPCSE reference code; paper: 2.6M)",
        "trainable_parameters": 294_912 + 2_362_368 + 1_538,
    },
    ("dcpcse", "bert-base"): {
        "source": "computed from the prefix layout (DCPCSE reference code, YJiangcm/DCPCSE)",
        "trainable_parameters": 294_912 + 590_592,
    },
    ("diffcse", "bert-base"): {"source": "DiffCSE paper (≈220M)", "trainable_parameters": 220_000_000},
}

# DiffCSE Table 2: SentEval transfer tasks, accuracy ×100 (logistic regression on frozen embeddings, SentEval "test"
# settings). DiffCSE's rows are its transfer models (Table 13 hyperparameters: presets `transfer`,
# `transfer-roberta-base`); the SimCSE rows are quoted from the SimCSE paper (Gao et al., 2021), "w/ MLM" being SimCSE
# with its auxiliary MLM objective (no preset here). Kept out of `published_keys()`: a transfer row is a second number
# for a (method, backbone, setting) that already has an STS row, not a separate model to reproduce.
TRANSFER_TASKS = ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc")


def _transfer(source: str, *scores: float) -> dict[str, float | str]:
    return _row((*TRANSFER_TASKS, "transfer_avg"), source, scores)


_SIMCSE_T2, _MLM = "SimCSE paper (DiffCSE Table 2)", "SimCSE paper, w/ MLM (DiffCSE Table 2)"
_DIFFCSE_TRANSFER = "DiffCSE paper (transfer model)"
TRANSFER: dict[tuple[str, str, str], dict[str, float | str]] = {
    ("simcse", "bert-base", "unsup"): _transfer(_SIMCSE_T2, 81.18, 86.46, 94.45, 88.88, 85.50, 89.80, 74.43, 85.81),
    ("simcse-mlm", "bert-base", "unsup"): _transfer(_MLM, 82.92, 87.23, 95.71, 88.73, 86.81, 87.01, 78.07, 86.64),
    ("diffcse", "bert-base", "unsup"): _transfer(
        _DIFFCSE_TRANSFER, 82.69, 87.23, 95.23, 89.28, 86.60, 90.40, 76.58, 86.86
    ),
    ("simcse", "roberta-base", "unsup"): _transfer(_SIMCSE_T2, 81.04, 87.74, 93.28, 86.94, 86.60, 84.60, 73.68, 84.84),
    ("simcse-mlm", "roberta-base", "unsup"): _transfer(_MLM, 83.37, 87.76, 95.05, 87.16, 89.02, 90.80, 75.13, 86.90),
    ("diffcse", "roberta-base", "unsup"): _transfer(
        _DIFFCSE_TRANSFER, 82.82, 88.61, 94.32, 87.71, 88.63, 90.40, 76.81, 87.04
    ),
}

# DiffCSE Tables 3–6 (the papers' tables): average dev accuracy of the 7 transfer tasks (SentEval "fasttest" devacc), BERT-base.
TRANSFER_DEV_AVG: dict[str, float] = {
    "simcse": 83.91,
    "simcse-batchnorm": 85.66,
    "diffcse": 85.95,
    "diffcse-no-batchnorm": 85.24,
}

# D2CSE ablation (Table 6), avg of 7 STS: variant → {(setting, cls_prompt): avg}.
D2CSE_ABLATION: dict[str, dict[tuple[str, bool], float]] = {
    "a": {("unsup", True): 78.22, ("unsup", False): 78.22, ("sup", True): 81.23, ("sup", False): 81.21},
    "b": {("unsup", True): 78.02, ("unsup", False): 78.38, ("sup", True): 81.32, ("sup", False): 81.18},
    "c": {("unsup", True): 78.74, ("unsup", False): 78.56, ("sup", True): 81.36, ("sup", False): 81.23},
    "d": {("unsup", True): 78.83, ("unsup", False): 79.02, ("sup", True): 81.52, ("sup", False): 81.25},
}


def backbone_family(backbone: str) -> str | None:
    """`bert-base-uncased` → `bert-base`; None for backbones no paper reports (e.g. the packaged MiniLM)."""
    name = backbone.rstrip("/").split("/")[-1].lower()
    for fam in ("bert-base", "bert-large", "roberta-base", "roberta-large"):
        if name.startswith(fam):
            return fam
    return None


# The published rows a run is compared with when no paper reports its backbone (the packaged MiniLM of the smoke
# presets): the BERT-base row of the same method and setting, labelled as a stand-in.
REFERENCE_FAMILY = "bert-base"


def reference_family(backbone: str) -> tuple[str, bool]:
    """The backbone family whose published row a run of `backbone` is compared with, and whether it stands in.

    A backbone no paper reports (e.g. the packaged MiniLM) is compared with the BERT-base row, labelled as a
    reference (`stands_in` True: "reference: BERT-base; this model is <backbone>"), never as its own row.

    Args:
        backbone: the run's backbone (HF id, local folder or `packaged:<name>`).

    Returns:
        `(family, stands_in)`: the family to look the row up under, and True when it is not the run's own.
    """
    family = backbone_family(backbone)
    return (family, False) if family is not None else (REFERENCE_FAMILY, True)


def setting_of(method: str, preset: str, supervised: bool) -> str:
    """The published-table setting of a run: `sup`, `unsup`, or for diffaug unsupervised `semi` / `semi-aux`.

    Args:
        method: the method name.
        preset: the preset name (a diffaug preset naming `aux` selects `semi-aux`).
        supervised: whether the run trains on supervised (NLI) data.

    Returns:
        The setting key used by the published results.
    """
    if method == "diffaug" and not supervised:
        return "semi-aux" if "aux" in preset else "semi"
    return "sup" if supervised else "unsup"


def published_keys() -> set[tuple[str, str, str]]:
    """Every (method, backbone family, setting) with a published number (STS, re-runs, retrieval, align/uniform,
    parameters at the unsupervised setting, and the D2CSE ablation cells on their base presets)."""
    keys = set(STS) | set(RERUNS) | set(RETRIEVAL) | set(ALIGN_UNIFORM)
    keys |= {(method, family, "unsup") for method, family in PARAMETERS}
    keys |= {
        (method, "bert-base", setting)
        for method, table in ABLATION.items()
        for cells in table.values()
        for setting, _ in cells
    }
    return keys


@dataclass(frozen=True)
class PublishedRows:
    """The published numbers of one method (`MethodSpec.published`), each table keyed as below; empty where no paper
    reports the method.

    Args:
        method: the registry name.
        sts: (backbone family, setting) → the STS row of `STS`.
        reruns: (family, setting) → a re-run by another paper (`RERUNS`).
        retrieval: (family, setting) → recall@k on STS-B test (`RETRIEVAL`).
        align_uniform: (family, setting) → alignment and uniformity (`ALIGN_UNIFORM`).
        transfer: (family, setting) → SentEval transfer accuracies (`TRANSFER`).
        parameters: family → trainable parameters at training time (`PARAMETERS`).
        ablation: variant → {(setting, [CLS] prompt): STS avg} of the paper's ablation table, if it has one.
    """

    method: str
    sts: dict[tuple[str, str], dict[str, float | str]] = field(default_factory=dict)
    reruns: dict[tuple[str, str], dict[str, float | str]] = field(default_factory=dict)
    retrieval: dict[tuple[str, str], dict[str, float | str]] = field(default_factory=dict)
    align_uniform: dict[tuple[str, str], dict[str, float | str]] = field(default_factory=dict)
    transfer: dict[tuple[str, str], dict[str, float | str]] = field(default_factory=dict)
    parameters: dict[str, dict[str, float | str]] = field(default_factory=dict)
    ablation: dict[str, dict[tuple[str, bool], float]] = field(default_factory=dict)


# The ablation table of each method whose paper has one (flows/ablate.py runs the variants of the model class).
ABLATION: dict[str, dict[str, dict[tuple[str, bool], float]]] = {"d2cse": D2CSE_ABLATION}


def rows_of(method: str) -> PublishedRows:
    """Every published number of `method`, by table (an unknown method has none)."""

    def of(table: dict[tuple[str, str, str], dict[str, float | str]]) -> dict[tuple[str, str], dict[str, float | str]]:
        return {(family, setting): row for (m, family, setting), row in table.items() if m == method}

    return PublishedRows(
        method=method,
        sts=of(STS),
        reruns=of(RERUNS),
        retrieval=of(RETRIEVAL),
        align_uniform=of(ALIGN_UNIFORM),
        transfer=of(TRANSFER),
        parameters={family: row for (m, family), row in PARAMETERS.items() if m == method},
        ablation=ABLATION.get(method, {}),
    )


# How `Reference.label` names a backbone family.
FAMILY_TITLES = {
    "bert-base": "BERT-base",
    "bert-large": "BERT-large",
    "roberta-base": "RoBERTa-base",
    "roberta-large": "RoBERTa-large",
}


@dataclass(frozen=True)
class Reference:
    """The published row a run is compared with (`reference_row`).

    Args:
        row: the row as published (its `source` and its columns).
        family: the backbone family of the row (`bert-base`, ...).
        stand_in: True when no paper reports the run's backbone and the row is the `REFERENCE_FAMILY` one.
        backbone: the run's backbone.
    """

    row: dict[str, float | str]
    family: str
    stand_in: bool
    backbone: str

    @property
    def label(self) -> str:
        """`published (BERT-base)`, or for a stand-in `published (BERT-base; this run uses packaged:minilm)` (a local
        folder by its name)."""
        title = FAMILY_TITLES.get(self.family, self.family)
        backbone = self.backbone.rstrip("/").rsplit("/", 1)[-1] if self.backbone.startswith("/") else self.backbone
        return f"published ({title}; this run uses {backbone})" if self.stand_in else f"published ({title})"


def reference_row(
    table: dict[tuple[str, str, str], dict[str, float | str]], method: str, backbone: str, setting: str
) -> Reference | None:
    """The published row of `table` (e.g. `STS`) for a run of `method` on `backbone` at `setting`: the row of the
    backbone's family, or the `REFERENCE_FAMILY` row when no paper reports the backbone; None when there is none.

    Args:
        table: a published table keyed (method, backbone family, setting).
        method: the run's method.
        backbone: the run's backbone (a hub name, a local folder or `packaged:minilm`).
        setting: the run's setting (`setting_of`).
    """
    family, stand_in = reference_family(backbone)
    row = table.get((method, family, setting))
    if row is None:
        return None
    return Reference(row=row, family=family, stand_in=stand_in, backbone=backbone)
