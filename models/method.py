"""What every training method is: a `SentenceEmbedder` that also computes its training loss.

A method is one module in `models/` holding a config dataclass (a `MethodConfig`) and a model class (a
`CSEModel`), registered in config/methods.py. The training loop knows nothing else about it:

- `training_step(batch, step, phase)` → `StepOutput(loss, metrics)` on a `TrainBatch` of `(B, n, T)` rows;
  `step` is the number of completed optimiser steps (schedules such as DCPCSE's MLM weight read it);
- `phases` names the training phases in order (DiffAug: "prefix" then "joint"; everyone else: "main") and
  `phase_parameters(phase)` the tensors the optimiser of that phase steps (`parameter_groups(phase)`: the same as
  AdamW groups, where a group may carry its own learning rate);
- `embed` (from `SentenceEmbedder`) is the evaluation embedding; `evaluation_pooler` names it;
- `backbone` is the pretrained encoder as loaded; its shape and `pretrained_fingerprint` (taken when the
  model is built, before any update) let a checkpoint refuse a different backbone at load time.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

import torch
from pydantic import AfterValidator, ConfigDict, ValidationInfo, model_validator
from pydantic.dataclasses import dataclass as config_dataclass
from torch import nn

from cse.models.batching import TrainBatch
from cse.models.embedder import SentenceEmbedder
from cse.models.grad_cache import NO_CHUNKS, RowChunks

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from cse.models.export.peft_plan import PeftPlan

SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# Every method config is a frozen pydantic dataclass with this configuration: its fields are checked by pydantic
# validators whenever it is made (from a dict by TrainConfig, or directly), and an unknown field is refused.
METHOD_CONFIG = ConfigDict(extra="forbid")


def must_be(words: str, test: Callable[[Any], bool]) -> AfterValidator:
    """The pydantic check of one config field, the metadata of its `Annotated` type: the value, once pydantic has read
    it as the field's type, passes when `test(value)` holds; else `ValueError("<field> must be <words>, got <value>")`.

    Args:
        words: what a valid value is, as the message says it ("positive", "in [0, 1)").
        test: True for a valid value.

    Examples:
        >>> from pydantic import ValidationError
        >>> from cse.models.methods.simcse import SimCSEConfig  # temperature: Positive
        >>> try:
        ...     SimCSEConfig(backbone="bert-base-uncased", temperature=0)
        ... except ValidationError as e:
        ...     print(e.errors()[0]["msg"])
        Value error, temperature must be positive, got 0.0
    """

    def check(value: Any, info: ValidationInfo) -> Any:
        if not test(value):
            raise ValueError(f"{info.field_name} must be {words}, got {value}")
        return value

    return AfterValidator(check)


# The field types the method configs share (`temperature: Positive = 0.05`); a check used by one field only is
# written in place as `Annotated[type, must_be(...)]`.
# (written as "not refused": `nan` passes these two, and the finite-number rule refuses it by name, as before)
Positive = Annotated[float, must_be("positive", lambda v: not v <= 0)]
NonNegative = Annotated[float, must_be(">= 0", lambda v: not v < 0)]
AtLeastOne = Annotated[int, must_be(">= 1", lambda v: v >= 1)]
DropoutRate = Annotated[float, must_be("in [0, 1)", lambda v: 0.0 <= v < 1.0)]


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class MethodConfig:
    """Base of every method's model config: the backbone name/path plus the method's own fields (a frozen pydantic
    dataclass; a subclass declares itself with `@config_dataclass(frozen=True, config=METHOD_CONFIG)` and checks its
    fields with the constrained types below (`Positive`, `AtLeastOne`, ..., or `Annotated[type, must_be(...)]`), and
    checks across fields with pydantic's `model_validator`)."""

    backbone: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {unknown}; known: {sorted(known)}")
        return cls(**data)


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class PromptConfig(MethodConfig):
    """The deep-prompt fields of the frozen-PLM methods (D2CSE, DCPCSE; layout of YJiangcm/DCPCSE): P, prefix dropout,
    optional reparametrisation (`prefix_projection`, hidden `prefix_hidden`) and the reference position shift.

    `train_prompts` (default True): False freezes the prompts (the prefix table or its reparametrisation, and D2CSE's
    [CLS] prompt) at their initial values: they are left out of the optimiser's groups, so only the method's other
    trainable parts learn (DCPCSE: the training-time MLP, and the LM head with `mlm`; D2CSE: the BN-MLP and the RTD
    head). A control that removes the prompts' learning; the frozen prompts are still applied and saved with
    every checkpoint.

    `prefix_init` (default "normal"): how the prefix table starts. "normal" is the references' N(0,
    initializer_range). "sep" starts every prompt as the backbone's own key and value of the end token ([SEP],
    RoBERTa's `</s>`) of the empty sentence at each layer (`end_token_prefix_rows`): copies of a slot the frozen
    encoder already attends to heavily (BERT's attention to [SEP]: Clark et al., 2019), instead of P near-zero slots
    that cost it points at step 0 (measured on MiniLM in docs/training.md). Initialising a prefix from a real token's activations is Li & Liang's (2021,
    prefix-tuning, §7.2) advice for small data; it is not the D2CSE/DCPCSE papers' setting. Not with
    `prefix_projection` (the table is then the projection's input, not the keys and values).
    """

    prefix_len: AtLeastOne = 16
    prefix_dropout: DropoutRate = 0.1
    prefix_projection: bool = False
    prefix_hidden: AtLeastOne = 512
    shift_positions: bool = True
    train_prompts: bool = True
    prefix_init: Literal["normal", "sep"] = "normal"

    @model_validator(mode="after")
    def _sep_init_sets_keys_and_values(self) -> Self:
        if self.prefix_init == "sep" and self.prefix_projection:
            raise ValueError("prefix_init 'sep' sets the prefix keys and values: not with prefix_projection")
        return self


@dataclass
class StepOutput:
    """One training forward: the loss to minimise and detached scalar metrics for logging."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def backbone_shape(backbone: PreTrainedModel) -> dict[str, Any]:
    """The shape of a backbone (its configuration values for the shape keys; missing keys are `None`).

    Args:
        backbone: a `transformers` model with a `config`.

    Returns:
        Shape key → value.
    """
    cfg = backbone.config
    return {k: getattr(cfg, k, None) for k in SHAPE_KEYS}


def backbone_fingerprint(backbone: PreTrainedModel) -> str:
    """A hash of a few pretrained tensors (first word-embedding rows, last layer's parameters)."""
    from cse.models.loading import word_embeddings
    from cse.models.prompts.families import encoder_layers  # the layer list of every supported encoder family

    h = hashlib.sha256()
    tensors = [word_embeddings(backbone).weight[:64]]
    tensors += [p for p in encoder_layers(backbone)[-1].parameters()][-4:]
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def drop_pooler(backbone: nn.Module) -> None:
    """No method evaluates with the pretrained pooler (SimCSE), so it is removed and never run."""
    if getattr(backbone, "pooler", None) is not None:
        backbone.pooler = None  # type: ignore[assignment]  # torch's __setattr__ stub omits None, which removes it


def set_backbone_dropout(backbone: nn.Module, p: float) -> None:
    """Set every dropout of an HF encoder to probability `p`: the config's `*dropout*` rates (hidden, attention,
    classifier...), every `nn.Dropout` module (transformers 5 reads the attention dropout of the eager and sdpa paths
    from the attention module's `nn.Dropout.p` in training mode) and float `*dropout*` attributes of modules
    (families that keep the attention rate as a plain number).

    Args:
        backbone: the encoder, modified in place.
        p: the probability, in [0, 1).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    cfg = getattr(backbone, "config", None)
    if cfg is not None:
        for key, value in list(vars(cfg).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(cfg, key, p)
    for module in backbone.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = p
            continue
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, p)


def load_backbone(
    config: MethodConfig, backbone: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """The given backbone/tokenizer, or both loaded from `config.backbone` (HF id, folder, `packaged:`)."""
    if backbone is None:
        from cse.models.loading import load_encoder, load_tokenizer

        backbone = load_encoder(config.backbone)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.backbone)
    return backbone, tokenizer


class CSEModel(SentenceEmbedder):
    """Base class of the trainable methods (see the module docstring for the contract).

    Everything the project knows about a method, beyond its registry entry (config/methods.py) and its presets, is an
    attribute or a method of its subclass:

    - `method`: the registry name; `config_class`: the typed model config;
    - `uses_corruption`, `phases`, `accepts_aux_nli`: what the pipeline runs for a job of it;
    - `paper` (one line: authors, year, title, venue), `bibtex` (its BibTeX entry) and `builds_on` (the registry names
      of the methods whose papers its model card cites too, in order);
    - `ablations`: named model-config variants of the paper's ablation table (flows/ablate.py runs them), if any;
    - `peft_plan(plan)`: how a checkpoint maps onto a PEFT prefix-tuning adapter (models/export/peft_export.py); the
      default, None, means the method exports no adapter. `exports_peft_adapter` is set on every subclass: whether
      it defines its own `peft_plan`;
    - `row_chunks`: how `training_step` runs its per-row passes (models/grad_cache.py: whole, or in cached chunks
      with exact gradients); set by `use_grad_cache`, which asks `grad_cache_refusal` first.
    """

    method: ClassVar[str]
    title: ClassVar[str]  # the name as the paper writes it (model cards, tables, deployment descriptions)
    summary: ClassVar[str]  # one line on what trains and how: the flow's description, the model card's first sentence
    config_class: ClassVar[type[MethodConfig]]
    uses_corruption: ClassVar[bool] = False  # reads the corruption stage's corrupted ids
    phases: ClassVar[tuple[str, ...]] = ("main",)
    accepts_aux_nli: ClassVar[bool] = False  # takes NLI rows batched beside the main ones (`aux_nli_batch_size`)
    paper: ClassVar[str] = ""
    bibtex: ClassVar[str] = ""
    builds_on: ClassVar[tuple[str, ...]] = ()
    ablations: ClassVar[dict[str, dict[str, Any]]] = {}
    exports_peft_adapter: ClassVar[bool] = False  # derived in __init_subclass__, never set by hand

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.exports_peft_adapter = cls.peft_plan is not CSEModel.peft_plan

    row_chunks: RowChunks = NO_CHUNKS  # per-row passes whole (the default) or in cached chunks (use_grad_cache)

    # State-dict prefixes the evaluation embedding never reads (a trainable discriminator, RTD head): left out of
    # saved checkpoints (resume state keeps them), so a DiffCSE checkpoint holds one encoder, not two.
    not_for_inference: ClassVar[tuple[str, ...]] = ()
    config: MethodConfig

    def attach_backbone(
        self,
        config: MethodConfig,
        backbone: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase | None,
        trainable: bool,
    ) -> PreTrainedModel:
        """Common construction: load the backbone/tokenizer if not given, set `config`/`tokenizer`, record the
        pretrained shape and fingerprint, drop the pretrained pooler, freeze it or not. Returns the backbone."""
        backbone, tokenizer = load_backbone(config, backbone, tokenizer)
        self.config = config
        # None only where a test builds a model from a backbone alone and never tokenizes
        self.tokenizer = tokenizer  # type: ignore[assignment]  # see the line above
        self.pretrained_shape = backbone_shape(backbone)  # taken before anything can update the backbone
        self.pretrained_fingerprint = backbone_fingerprint(backbone)
        drop_pooler(backbone)
        backbone.requires_grad_(trainable)
        return backbone

    @property
    @abstractmethod
    def backbone(self) -> PreTrainedModel:
        """The (possibly fine-tuned) pretrained encoder."""

    @property
    def hidden_size(self) -> int:
        return self.backbone.config.hidden_size

    @property
    @abstractmethod
    def evaluation_pooler(self) -> str:
        """Name of the evaluation embedding (`cls_before_pooler`, `cls`, `mask`, ...)."""

    @classmethod
    def backbone_pooling(cls, config: MethodConfig) -> tuple[str, str | None]:
        """How the pretrained backbone alone is scored before training (the job's step-0 baseline, the row "backbone
        before training"): the pooler of this method's evaluation embedding, read from the backbone's own output, and
        the prompt template each sentence is wrapped in (None: the sentence as it is).

        `cls` (the method's MLP over [CLS], which training starts from random weights) becomes `cls_before_pooler`;
        a method whose pooler depends on its config (a property) is scored on `cls_before_pooler`. A method that
        reads a prompt template overrides this.

        Args:
            config: the method's model config.
        """
        pooler = cls.evaluation_pooler if isinstance(cls.evaluation_pooler, str) else "cls_before_pooler"
        return ("cls_before_pooler" if pooler == "cls" else pooler), None

    def phase_parameters(self, phase: str) -> list[nn.Parameter]:
        """The tensors the optimiser of `phase` steps (default: every trainable tensor); refuses an empty set."""
        if phase not in self.phases:
            raise ValueError(f"{self.method} has phases {self.phases}, not {phase!r}")
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:  # the error names the config field that froze the prompts
            hint = (
                " (model.train_prompts=False froze the prompts and nothing else is trainable)"
                if getattr(self.config, "train_prompts", True) is False
                else ""
            )
            raise ValueError(f"{self.method}: nothing to train in phase {phase!r}{hint}")
        return params

    def parameter_groups(self, phase: str) -> list[dict[str, Any]]:
        """AdamW parameter groups of `phase`: one group at the phase's learning rate by default. A group with its own
        `"lr"` keeps it (D2CSE ablation (b): the trainable discriminator); the linear decay scales every group."""
        return [{"params": self.phase_parameters(phase)}]

    def rate_groups(self, phase: str, own: list[tuple[str, list[nn.Module], float]]) -> list[dict[str, Any]]:
        """`parameter_groups` of a method with parts at a learning rate of their own: the phase's tensors of each
        `(name, modules, lr)` in a named group at `lr`, in order, after one group of the rest at the phase's rate."""
        params = self.phase_parameters(phase)
        if not own:
            return [{"params": params}]
        owned = [(name, {id(p) for m in modules for p in m.parameters()}, lr) for name, modules, lr in own]
        taken = set().union(*(ids for _, ids, _ in owned))
        groups = [{"params": [p for p in params if id(p) not in taken]}]
        return groups + [
            {"params": [p for p in params if id(p) in ids], "lr": lr, "name": name} for name, ids, lr in owned
        ]

    def trainable_parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @abstractmethod
    def training_step(self, batch: TrainBatch, step: int | torch.Tensor = 0, phase: str = "main") -> StepOutput:
        """Loss of one batch in train mode.

        The step reads no tensor value on the host (no `.item()`, `bool(tensor)`, data-dependent shapes): a compiled
        step is one graph, and an eager step on a GPU never waits for it. Checks of the rows' values belong in
        `check_batch`. `step` is an int in eager mode and a 0-d device tensor in a compiled step.
        """

    def check_batch(self, batch: TrainBatch) -> None:
        """Refuse a training batch this method cannot use, reading its values: the trainer calls it on the host
        batch before it moves to the device (default: nothing to check).

        Args:
            batch: the host batch.
        """

    def describe(self) -> dict[str, Any]:
        return {
            "class": type(self).__name__,
            "method": self.method,
            "backbone": self.config.backbone,
            "pooler": self.evaluation_pooler,
        }

    @classmethod
    def grad_cache_refusal(cls, config: MethodConfig) -> str | None:
        """Why a model of this configuration cannot train with exact gradient caching, or None (it can).

        A method's per-row passes go through `self.row_chunks.map`; a configuration whose loss ties rows of different
        chunks together outside the cached vectors overrides this with the reason. The job's config checks it
        before anything runs (`cse.config.training.TrainConfig`).

        Args:
            config: the method's model config.
        """
        return None

    def use_grad_cache(self, chunks: RowChunks) -> None:
        """Run the per-row passes of `training_step` as `chunks` says (models/grad_cache.py).

        Args:
            chunks: the chunking; `RowChunks()` (no chunk size) runs every pass whole.

        Raises:
            ValueError: chunking is asked for a configuration that refuses it (`grad_cache_refusal`), with the reason.
        """
        reason = type(self).grad_cache_refusal(self.config) if chunks.enabled else None
        if reason:
            raise ValueError(f"grad_cache.chunk_size: {self.method} cannot cache gradients exactly here: {reason}")
        self.row_chunks = chunks

    def use_unpadded(self, fill: float | None) -> None:
        """Run the encoder and discriminator passes of `training_step` over the real tokens only
        (`cse.models.prompts.packing`: packed at a fixed budget of `fill` × rows × length token slots per pass), or
        padded (None, the default). A discriminator pass whose loss reads pad positions (the RTD mean over padding)
        stays padded.

        Args:
            fill: the budget's share of a pass's padded positions, in (0, 1], or None.

        Raises:
            TypeError: a backbone family the packed passes do not support (`PromptedBackbone.unpad`).
            ValueError: `fill` outside (0, 1].
        """
        unpad_prompted(self, fill)

    def peft_plan(self, plan: PeftPlan) -> PeftPlan | None:
        """How this model's checkpoint maps onto a PEFT prefix-tuning adapter (models/export/peft_export.py).

        `plan` holds what every prompted model shares (CLS pooling, the notes on prefix dropout and position shift);
        a method that exports an adapter adds its own pooling, carried modules and notes and returns it. The default
        returns None: the method has no prompts to export (it fine-tunes the whole encoder), and the class's
        `exports_peft_adapter` is False.

        Args:
            plan: the shared part of the plan, to complete.
        """
        return None


def unpad_prompted(model: nn.Module, fill: float | None) -> None:
    """`PromptedBackbone.unpad(fill)` on every prompted backbone of `model` (the modules with an `unpad`; `fill`
    checked first)."""
    from cse.models.prompts.packing import packed_budget

    if fill is not None:
        packed_budget(1, 1, fill)  # refuses a fill outside (0, 1]
    for module in model.modules():
        unpad = getattr(module, "unpad", None)
        if callable(unpad):
            unpad(fill)


class FineTunedModel:
    """Mixin for methods whose `self.encoder` is the whole pretrained encoder, fine-tuned (SimCSE, DiffCSE): the
    `backbone` accessor and the CLS pass (unpadded in training after `use_unpadded`: through the `PromptedBackbone`
    without prompts over the same encoder that `cse.models.prompts.backbone.unpad_fine_tuned` keeps outside the
    module tree, so no state-dict name changes)."""

    encoder: PreTrainedModel
    training: bool

    @property
    def backbone(self) -> PreTrainedModel:
        return self.encoder

    def encode_cls(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Last-layer state at position 0 of the encoder on `(B', T)` rows: `(B', d)` (before any MLP)."""
        view = self.__dict__.get("_unpadded_encoder")
        if view is not None and self.training:
            return view(input_ids, attention_mask, token_type_ids, prefix=False).last_hidden_state[:, 0]
        out = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=True
        )
        return out.last_hidden_state[:, 0]
