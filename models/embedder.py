"""The encoder interface the evaluator consumes, and its implementation for plain HF encoders.

`SentenceEmbedder` is what every method's evaluation model is: an `nn.Module` with a `tokenizer`
and `embed(input_ids, attention_mask, token_type_ids=None) -> [B, d]` (called in eval mode under
`torch.inference_mode`; the caller switches modes). `token_ids` turns raw sentences into unpadded
token ids (override it for prompt templates). `PooledEncoder` wraps an HF backbone with a pooler
of `cse.models.pooling`. Trained checkpoints (a folder with `cse_model.json` + `weights.safetensors`)
are loaded by `cse.models.checkpoint` (`load_checkpoint_folder`), which builds them from their method's class.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cse.models.loading import load_encoder, load_tokenizer
from cse.models.pooling import check_pooler, needs_hidden_states, pool

CHECKPOINT_CONFIG = "cse_model.json"
CHECKPOINT_WEIGHTS = "weights.safetensors"


class CheckpointMismatchError(ValueError):
    """A checkpoint does not belong to the requested backbone or pooler."""


class SentenceEmbedder(nn.Module, metaclass=ABCMeta):
    """Sentences → vectors. Subclasses set `tokenizer` and implement `embed`."""

    tokenizer: PreTrainedTokenizerBase

    def token_ids(self, sentences: Sequence[str]) -> list[list[int]]:
        """Unpadded token ids with special tokens, no truncation (SentEval encodes whole sentences)."""
        return self.tokenizer(list(sentences), add_special_tokens=True, truncation=False)["input_ids"]

    @property
    def pad_token_id(self) -> int:
        pid = self.tokenizer.pad_token_id
        return 0 if pid is None else int(pid)

    @property
    def device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def describe(self) -> dict[str, Any]:
        """A JSON-able description for run records (subclasses add their own keys)."""
        return {"class": type(self).__name__}

    @abstractmethod
    def embed(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """[B, T] token ids and mask → [B, d] sentence embeddings."""


class FirstTokenPooler(nn.Module):
    """Adapts an HF pooler (which reads position 0 of a sequence) to take a [B, d] CLS vector."""

    def __init__(self, hf_pooler: nn.Module):
        super().__init__()
        self.hf_pooler = hf_pooler

    def forward(self, cls: Tensor) -> Tensor:
        return self.hf_pooler(cls.unsqueeze(1))


class PooledEncoder(SentenceEmbedder):
    """A plain HF encoder + pooler. `cls` without an `mlp` uses the backbone's pretrained pooler.

    `template` (optional) wraps every sentence, e.g. 'This sentence : "{sentence}" means [MASK] .';
    a literal `[MASK]` in it is replaced by the tokenizer's mask token. `first_layer` is the
    `hidden_states` index `avg_first_last` takes as "first" (0 = embeddings, 1 = first layer).
    """

    def __init__(
        self,
        backbone: nn.Module,
        pooler_name: str,
        mlp: nn.Module | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase,
        first_layer: int = 0,
        template: str | None = None,
        name: str | None = None,
    ):
        super().__init__()
        self.pooler_name = check_pooler(pooler_name)
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.first_layer = first_layer
        self.name = name
        if pooler_name == "cls" and mlp is None:
            hf_pooler = getattr(backbone, "pooler", None)
            if hf_pooler is None:
                raise ValueError("pooler 'cls' needs an MLP: the backbone has no pretrained pooler and none was given")
            mlp = FirstTokenPooler(hf_pooler)
        self.mlp = mlp if pooler_name == "cls" else None
        if template is not None and "{sentence}" not in template:
            raise ValueError(f"template {template!r} has no '{{sentence}}' placeholder")
        self.template = (
            template.replace("[MASK]", tokenizer.mask_token) if template and tokenizer.mask_token else template
        )
        self.mask_token_id = tokenizer.mask_token_id
        if pooler_name == "mask":
            if self.mask_token_id is None:
                raise ValueError("pooler 'mask' needs a tokenizer with a mask token")
            if template is None:
                raise ValueError(
                    "pooler 'mask' needs a prompt template containing [MASK], "
                    "e.g. 'This sentence : \"{sentence}\" means [MASK] .'"
                )
            if tokenizer.mask_token not in (self.template or ""):  # a template is given here
                raise ValueError(f"template {template!r} contains no mask token ({tokenizer.mask_token})")

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        pooler_name: str,
        *,
        first_layer: int = 0,
        template: str | None = None,
        device: str | torch.device = "cpu",
    ) -> PooledEncoder:
        """Load an HF id / local folder / `packaged:minilm` with its tokenizer, in eval mode."""
        check_pooler(pooler_name)
        loaded = load_encoder(name_or_path, output_loading_info=True)
        backbone, info = cast("tuple[PreTrainedModel, dict[str, list[str]]]", loaded)  # with output_loading_info
        missing = [k for k in info.get("missing_keys", ()) if "pooler" in k]
        if pooler_name == "cls" and missing:
            raise ValueError(
                f"{name_or_path!r} has no pretrained pooler weights ({missing}); pooler 'cls' would use "
                "random weights: use 'cls_before_pooler' or a checkpoint with a trained MLP"
            )
        enc = cls(
            backbone,
            pooler_name,
            tokenizer=load_tokenizer(name_or_path),
            first_layer=first_layer,
            template=template,
            name=name_or_path,
        )
        return enc.to(device).eval()

    def token_ids(self, sentences: Sequence[str]) -> list[list[int]]:
        if self.template is not None:
            sentences = [self.template.replace("{sentence}", s) for s in sentences]
        return super().token_ids(sentences)

    def describe(self) -> dict[str, Any]:
        cfg = getattr(self.backbone, "config", None)
        return {
            "class": type(self).__name__,
            "model": self.name,
            "pooler": self.pooler_name,
            "first_layer": self.first_layer,
            "template": self.template,
            "architecture": getattr(cfg, "model_type", None),
            "hidden_size": getattr(cfg, "hidden_size", None),
            "layers": getattr(cfg, "num_hidden_layers", None),
        }

    def embed(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hs = needs_hidden_states(self.pooler_name)
        out = self.backbone(**kwargs, output_hidden_states=hs, return_dict=True)
        return pool(
            self.pooler_name,
            out.last_hidden_state,
            attention_mask,
            hidden_states=out.hidden_states if hs else None,
            input_ids=input_ids,
            mask_token_id=self.mask_token_id,
            mlp=self.mlp,
            first_layer=self.first_layer,
        )
