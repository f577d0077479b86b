"""Parameters of the data stages. Defaults follow the papers and their reference code."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cse.config.finite import FINITE_ONLY, refuse_booleans
from cse.config.limits import cut
from cse.config.presets import PRESET_DATA_URL
from cse.config.suggest import did_you_mean
from cse.storage.hf_sources import HFSource
from cse.storage.secrets import register_secrets_in

_HF_DATA = PRESET_DATA_URL
WIKI1M_URL = f"{_HF_DATA}/wiki1m_for_simcse.txt"
NLI_URL = f"{_HF_DATA}/nli_for_simcse.csv"
SENTEVAL_URL = f"{_HF_DATA}/senteval.tar"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, **FINITE_ONLY)  # inf / nan refused (config/finite.py)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """Unknown keys refused by name with the known ones (pydantic's error adds the field path above them), and a
        boolean given for a number (config/finite.py)."""
        if isinstance(data, Mapping) and (unknown := sorted(str(k) for k in data if k not in cls.model_fields)):
            raise ValueError(  # each key, and the list, cut: a 10 MB override is not echoed whole
                f"unknown {cls.__name__} key{'s' if len(unknown) > 1 else ''} "
                f"{cut(', '.join(repr(cut(k, 60)) for k in unknown[:10]))}"
                f"{f' and {len(unknown) - 10:,d} more' if len(unknown) > 10 else ''}{did_you_mean(unknown, cls.model_fields)}; "
                f"known: {', '.join(cls.model_fields)}"
            )
        refuse_booleans({k: f.annotation for k, f in cls.model_fields.items()}, data, cls.__name__)
        return data

    @model_validator(mode="after")
    def _remember_credentials(self):
        """A credential written in a value (a source URL's password) is remembered as a known secret, so that every
        exit masks it, also where only a piece of the URL is shown (`cse.storage.secrets`)."""
        for value in self.__dict__.values():
            if isinstance(value, str) and ("@" in value or "=" in value):
                register_secrets_in(value)
        return self


_HF_HELP = (
    "Hugging Face dataset(s) instead of the file: `hf:<dataset>[:<config>][@<split>]` or {dataset, config, "
    "split, data_files, columns, values, ...} (storage/hf_sources.py), a hub id, a save_to_disk folder or a "
    "folder of Parquet files; several are read one after the other"
)


class _Source(_Config):
    """Where a source's rows come from: `path` (a local file or folder), else `hf` (HF datasets), else the
    `$CSE_SOURCE_MIRROR`, else `url`. `sha256` pins the file, or the content hash of the rows of `hf`."""

    path: str | None = None
    hf: tuple[HFSource, ...] = Field(default=(), description=_HF_HELP)

    @field_validator("hf", mode="before")
    @classmethod
    def _one_or_more(cls, v):
        return (v,) if isinstance(v, (str, dict, HFSource)) else v

    @model_validator(mode="after")
    def _one_origin(self):
        if self.path is not None and self.hf:
            raise ValueError("set either path (a file or folder) or hf (Hugging Face datasets), not both")
        return self


class WikiSource(_Source):
    """Wiki1M: one sentence a line (an HF source: a `text` column). `path` (a local file) wins over `url` when set."""

    url: str = WIKI1M_URL
    expected_lines: int | None = Field(
        default=None, description="checked after reading when set (1,000,000 for the full file)"
    )
    sha256: str | None = Field(default=None, description="checked against the file (or the rows of hf) when set")


class NliSource(_Source):
    """SimCSE's NLI triplets (`sent0,sent1,hard_neg` with a header; an HF source: those three columns)."""

    url: str = NLI_URL
    expected_rows: int | None = None
    sha256: str | None = None


class SentEvalSource(_Source):
    """SentEval STS/SICK data: `path` is a folder holding `STS/` and `SICK/` (or `downstream/STS` ...); an HF source
    gives sentence1, sentence2, score and task/subset/split (columns or `values`), e.g. the MTEB STS sets."""

    url: str = SENTEVAL_URL
    sha256: str | None = None
    expected_rows: dict[str, int] | None = Field(
        default_factory=lambda: dict(_senteval_expected_rows()),
        description="scored pairs per task (sts12 …) or split (stsb/dev, sickr/test …), checked after reading; "
        "default: the counts of ../shared/data/README.md; None skips the check",
    )


def _senteval_expected_rows() -> dict[str, int]:
    from cse.storage.readers import SENTEVAL_EXPECTED_ROWS

    return SENTEVAL_EXPECTED_ROWS


Dataset = Literal[
    "wiki1m", "nli", "sts", "transfer"
]  # transfer: SentEval's 7 classification tasks (tasks/transfer_data.py)


class IngestConfig(_Config):
    """Configuration of the ingest stage: which datasets to fetch, their sources, retries and validation."""

    datasets: tuple[Dataset, ...] = ("wiki1m", "nli", "sts")
    wiki: WikiSource = WikiSource()
    nli: NliSource = NliSource()
    senteval: SentEvalSource = SentEvalSource()
    download_retries: int = Field(default=3, ge=0)
    strict: bool = Field(
        default=False,
        description="control characters and over-long lines in a source are errors "
        "naming file and line (by default they are counted in the manifest and the MLflow run)",
    )
    max_line_chars: int = Field(
        default=10_000, ge=1, description="a source line longer than this is counted (an error with strict)"
    )
    verify: bool = Field(
        default=False,
        description="a cache hit also checks the content hash of every file it "
        "reuses (file sizes and row counts are always checked)",
    )


class TokenizeConfig(_Config):
    """Pre-tokenisation of training text. max_length counts [CLS]/[SEP] (plain HF truncation)."""

    tokenizer: str = Field(
        default="bert-base-uncased",
        min_length=1,
        pattern=r"\S",
        description="HF tokenizer id, local folder or packaged:minilm (never empty)",
    )
    max_length: int = Field(default=32, ge=4)
    batch_size: int = Field(default=10_000, ge=1)
    verify: bool = Field(
        default=False,
        description="a cache hit also checks the content hash of every file it "
        "reuses (file sizes and row counts are always checked)",
    )


# The corruption seed of the stage run on its own (`CorruptConfig.seed` None outside a training job): the seed of the
# training presets, so a stand-alone corruption is the one a seed-42 job reads.
STANDALONE_SEED = 42

# Unsupervised D2CSE/DiffCSE: 2 dropout views x 2 epochs, each with its own corruption (DiffCSE, Chuang et al., 2022).
UNSUP_REFERENCE_VARIANTS = 4


class CorruptConfig(_Config):
    """Offline replaced-token corruption with a frozen masked-LM generator (DiffCSE, Chuang et al., 2022)."""

    generator: str = Field(
        default="distilbert-base-uncased",
        description="the frozen masked LM: an HF id, a local model folder, `generator:<key>` (a dataset of the "
        "fit-generator stage) or `random-init:<size>`; unused with mode unigram",
    )
    mask_ratio: float = Field(default=0.3, gt=0.0, lt=1.0)
    mode: Literal["argmax", "sample", "unigram"] = Field(
        default="argmax",
        description="argmax = the reference code (greedy); sample = draw from the generator's softmax (DiffCSE paper "
        "text); unigram = no generator: draw from the tokens dataset's non-special token frequencies (a "
        "cheap contrast)",
    )
    positions: Literal["masked", "all"] = Field(
        default="masked",
        description="where G's prediction replaces the input: masked = the selected positions only (3x cheaper); "
        "all = every real token but [CLS], as the reference code (G may rewrite an unmasked token)",
    )
    variants: int | None = Field(
        default=None,
        ge=1,
        description="independent corruptions per sentence; None = the reference's fresh corruption for every view of "
        "every epoch (a training job resolves it to epochs x views per column; the stage alone uses "
        f"{UNSUP_REFERENCE_VARIANTS}, the 2 views x 2 epochs of unsupervised D2CSE/DiffCSE); 1 = the cheaper "
        "single corruption shared by all views and epochs",
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        description="seed of the masks, random replacements and generator dropout; None = follow the training job's "
        f"`seed` (the references draw them on the fly from the training-seeded RNG, so every seed of a job "
        f"trains on its own corruptions); the stage run alone uses {STANDALONE_SEED}, a seed-{STANDALONE_SEED} "
        "job's corruption",
    )
    shard_size: int = Field(default=50_000, ge=1, description="sentences per shard")
    batch_size: int = Field(default=256, ge=1)
    generator_dropout: bool = Field(
        default=True,
        description="run the generator in train mode (dropout on), as the reference code does (voidism/DiffCSE)",
    )
    hard: bool = Field(
        default=False,
        description="hard corruption: the generator's best token other than the original (its argmax, or its "
        "sample, with the original token's logit removed), so that every predicted position is replaced; False = "
        "the reference's pick, which may give back the original (about the generator's top-1 accuracy of the "
        "positions stay as they were). Not with mode unigram",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    bf16: bool = Field(default=True, description="bf16 autocast on GPU (ignored on CPU)")

    @property
    def resolved_variants(self) -> int:
        """The number of variants the stage writes (`variants`, or the unsupervised reference default)."""
        return self.variants if self.variants is not None else UNSUP_REFERENCE_VARIANTS

    @property
    def resolved_seed(self) -> int:
        """The seed the stage uses (`seed`, or the stand-alone default when no training job set it)."""
        return self.seed if self.seed is not None else STANDALONE_SEED

    def resolved(self) -> CorruptConfig:
        """This config with `variants` and `seed` made explicit (what the stage computes and hashes)."""
        update = {
            k: v
            for k, v in (("variants", self.resolved_variants), ("seed", self.resolved_seed))
            if getattr(self, k) is None
        }
        return self.model_copy(update=update) if update else self

    def for_job(self, job_seed: int, variants: int) -> CorruptConfig:
        """The corruption a training job reads: `variants` when unset, and the job's seed unless `seed` was set."""
        update = {k: v for k, v in (("variants", variants), ("seed", job_seed)) if getattr(self, k) is None}
        return self.model_copy(update=update) if update else self

    @field_validator("generator")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("generator must name an HF model id or a local folder")
        return v

    @model_validator(mode="after")
    def _unigram_masked_only(self):
        if self.mode == "unigram" and self.positions != "masked":
            raise ValueError("corrupt.mode 'unigram' replaces the masked positions only: positions must be 'masked'")
        if self.mode == "unigram" and self.hard:
            raise ValueError("corrupt.hard removes the generator's original-token logit: mode 'unigram' has none")
        return self


class GeneratorConfig(_Config):
    """Fitting a masked-LM head on a frozen encoder (the fit-generator stage): BERT's MLM head, masking and loss."""

    backbone: str = Field(
        default="packaged:minilm",
        min_length=1,
        pattern=r"\S",
        description="the frozen encoder: an HF id, a local folder or packaged:minilm; its vocabulary "
        "must be the tokens dataset's",
    )
    mask_ratio: float = Field(default=0.15, gt=0.0, lt=1.0, description="BERT's 15 %, then 80/10/10")
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0, description="share of sentences held out")
    max_heldout: int = Field(default=1000, ge=1, description="at most this many held-out sentences")
    split_seed: int = Field(default=0, description="the seeded permutation choosing the held-out sentences")
    epochs: int = Field(
        default=1, ge=1, description="passes of the frozen encoder over the training split, each with fresh masks"
    )
    reuse: int = Field(
        default=4,
        ge=1,
        description="head passes over each chunk of encoder features (computed once "
        "under no_grad): the encoder's forward pass is the cost, the head's steps are cheap",
    )
    chunk_batches: int = Field(
        default=32,
        ge=1,
        description="batches whose features are held at once (memory: "
        "chunk_batches x batch_size x masked tokens x hidden floats)",
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="stop after this many head steps (None: epochs x reuse x batches per epoch)"
    )
    batch_size: int = Field(default=64, ge=1, description="sentences per step")
    lr: float = Field(default=2e-3, gt=0.0)
    backbone_lr: float | None = Field(
        default=None,
        gt=0.0,
        description="None: the backbone stays frozen and only the MLM head learns (the default); a rate: full MLM "
        "fine-tuning, the backbone (and the tied word embeddings) at this rate, the head at `lr`; `reuse` must be 1 "
        "(no cached features: each step runs the backbone with dropout)",
    )
    weight_decay: float = Field(default=0.01, ge=0.0)
    warmup_ratio: float = Field(default=0.05, ge=0.0, lt=1.0)
    bias_init: Literal["unigram", "zeros"] = Field(
        default="unigram",
        description="output bias at the start: the centred log unigram frequencies of the training "
        "split, or zeros (BERT's init)",
    )
    eval_every: int = Field(default=100, ge=1, description="held-out accuracy every this many steps (and at the end)")
    seed: int = Field(default=0, description="head init, masks, batch order")
    baseline_generator: str | None = Field(
        default="random-init:distilbert-tiny",
        description="a masked LM scored on the same held-out positions for contrast "
        "(the smoke presets' generator); None: none",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _fine_tuning_reads_no_cached_features(self):
        if self.backbone_lr is not None and self.reuse != 1:
            raise ValueError(
                f"backbone_lr (full MLM fine-tuning) runs the backbone at every step: reuse must be 1, got {self.reuse}"
            )
        return self


def local_mirror_ingest(shared_data: str | Path) -> IngestConfig:
    """The ingestion config that reads the local mirror (`../shared/data`) instead of the network."""
    root = Path(shared_data)
    return IngestConfig(
        wiki=WikiSource(path=str(root / "wiki1m_head.txt")),
        nli=NliSource(path=str(root / "snli_triplets.csv")),
        senteval=SentEvalSource(path=str(root / "senteval")),
    )
