"""Parameters of the data stages. Defaults follow the papers (see ../shared/design/methods.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_HF_DATA = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main"
WIKI1M_URL = f"{_HF_DATA}/wiki1m_for_simcse.txt"
NLI_URL = f"{_HF_DATA}/nli_for_simcse.csv"
SENTEVAL_URL = f"{_HF_DATA}/senteval.tar"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WikiSource(_Config):
    """Wiki1M: one sentence a line. `path` (a local file) wins over `url` when set."""

    url: str = WIKI1M_URL
    path: str | None = None
    expected_lines: int | None = Field(
        default=None, description="checked after reading when set (1,000,000 for the full file)"
    )
    sha256: str | None = Field(default=None, description="checked against the file when set")


class NliSource(_Config):
    """SimCSE's NLI triplets (`sent0,sent1,hard_neg` with a header)."""

    url: str = NLI_URL
    path: str | None = None
    expected_rows: int | None = None
    sha256: str | None = None


class SentEvalSource(_Config):
    """SentEval STS/SICK data: `path` is a folder holding `STS/` and `SICK/` (or `downstream/STS` ...)."""

    url: str = SENTEVAL_URL
    path: str | None = None
    sha256: str | None = None


Dataset = Literal["wiki1m", "nli", "sts"]


class IngestConfig(_Config):
    datasets: tuple[Dataset, ...] = ("wiki1m", "nli", "sts")
    wiki: WikiSource = WikiSource()
    nli: NliSource = NliSource()
    senteval: SentEvalSource = SentEvalSource()
    download_retries: int = Field(default=3, ge=0)


class TokenizeConfig(_Config):
    """Pre-tokenisation of training text. max_length counts [CLS]/[SEP] (plain HF truncation)."""

    tokenizer: str = "bert-base-uncased"
    max_length: int = Field(default=32, ge=4)
    batch_size: int = Field(default=10_000, ge=1)


class CorruptConfig(_Config):
    """Offline replaced-token corruption with a frozen masked-LM generator (methods.md §4)."""

    generator: str = "distilbert-base-uncased"
    mask_ratio: float = Field(default=0.3, gt=0.0, lt=1.0)
    mode: Literal["argmax", "sample"] = Field(
        default="argmax",
        description="argmax = the reference code (greedy); sample = draw from the generator's softmax (DiffCSE paper text)",
    )
    variants: int = Field(default=1, ge=1, description="independent corruptions per sentence")
    seed: int = 42
    shard_size: int = Field(default=50_000, ge=1, description="sentences per shard")
    batch_size: int = Field(default=256, ge=1)
    generator_dropout: bool = Field(
        default=False,
        description="run the generator in train mode as the reference code does (dropout on)",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    bf16: bool = Field(default=True, description="bf16 autocast on GPU (ignored on CPU)")

    @field_validator("generator")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("generator must name an HF model id or a local folder")
        return v


def local_mirror_ingest(shared_data: str | Path) -> IngestConfig:
    """The ingestion config that reads the local mirror (`../shared/data`) instead of the network."""
    root = Path(shared_data)
    return IngestConfig(
        wiki=WikiSource(path=str(root / "wiki1m_head.txt")),
        nli=NliSource(path=str(root / "snli_triplets.csv")),
        senteval=SentEvalSource(path=str(root / "senteval")),
    )
