"""Export a prompt method's checkpoint (D2CSE, DCPCSE, DiffAug) as a standard PEFT prefix-tuning adapter.

The adapter folder holds PEFT's own files (`adapter_config.json`: `PREFIX_TUNING`, `FEATURE_EXTRACTION`,
`prefix_projection=False`; `adapter_model.safetensors`: `prompt_embeddings`, the `P × 2·L·d` key/value rows in the
P-tuning v2 layout that `cse.models.prompts.prefixes.PrefixEncoder` and PEFT share), the tokenizer, `cse_peft.json`
(the pooling and the notes below, machine-readable), `peft_embed.py` (a copy of `models/export/peft_loader.py`, which
embeds sentences with transformers + peft only); its README is the job's model card (`cse.tracking.model_card`).
`PeftModel.from_pretrained(AutoModel.from_pretrained(base), folder)`
followed by the recorded pooling gives our `embed` (checked at export time on probe sentences, and by the tests on
the STS-B test sentences, within 1e-5).

Why it is exact (transformers 5.23 + peft 0.21.2, see `models/export/peft_loader.py`): PEFT hands the prefix to the stock
BERT/RoBERTa model as a `DynamicCache`; its self-attention prepends the cached keys/values, the position numbering
starts after the P cached slots (the HF 4.x shift our prompts were trained with, `shift_positions=True`), the mask
builder takes the key length from PEFT's prefix-extended 2-D mask (transformers special-cases prefix tuning there).

Features a plain prefix-tuning adapter cannot hold are carried with PEFT's own `modules_to_save` where that is exact:
- D2CSE's [CLS] prompt (D2CSE paper) replaces the word embedding at position 0. Position 0 is the only token that reads
  position-embedding row `r` = P (BERT) or `padding_idx + 1 + P` (RoBERTa) under the shift, so adding
  `p_cls − E_word[CLS]` to that row gives the same embedding-layer input: `modules_to_save=["embeddings.position_embeddings"]`.
- DCPCSE's supervised `cls` MLP (Linear + tanh on the first token) is exactly an HF pooler:
  `modules_to_save=["pooler"]`, pooling `pooler_output`.
- A reparametrised prefix (DiffAug, `prefix_projection=True`) is stored as its `P × 2·L·d` output (PEFT's inference
  form; the MLP only matters for training).
- DiffAug fine-tunes its encoder: the fine-tuned encoder is written as a standard transformers folder `base_model/`
  inside the export and is the adapter's base.
What cannot be expressed is refused (`PeftExportError`) unless `allow_inexact=True`, which writes the adapter marked
`exact=False`; every export lists its notes as `"<code>: <sentence>"` lines (`PeftExport.limitations`).
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from cse.models.batching import pad_sequences
from cse.models.export import peft_loader
from cse.models.export.peft_plan import PeftPlan
from cse.storage.atomic import atomic_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from cse.models.method import CSEModel
    from cse.models.prompts.backbone import PromptedModel
    from cse.models.prompts.prefixes import PrefixEncoder

    class PromptedMethod(PromptedModel, CSEModel):
        """The model of a method that exports an adapter (D2CSE, DCPCSE, DiffAug): a `CSEModel` on prompts."""


TOLERANCE = 1e-5
LOADER_FILE = "peft_embed.py"
FORMAT_VERSION = 1
PROBE_SENTENCES = (
    "A man is playing a guitar.",
    "Two dogs run along the beach while the sun sets behind them .",
    "nobody",
    "The stock market fell 3.5 % on Tuesday, its worst day since March.",
    "a woman slices an onion",
    "Is this the way to the station?",
)


class PeftExportError(ValueError):
    """The checkpoint cannot be written as a PEFT prefix adapter that reproduces our embeddings."""


@dataclass(frozen=True)
class PeftExport:
    """What `export_peft_adapter` wrote.

    `exact`: the adapter + `pooling` reproduce our `embed` (verified on probe sentences within `TOLERANCE`; no feature
    left out). `limitations`: `"<code>: <sentence>"` lines for the model card. `base_model`: `base_model_name_or_path`
    of the adapter (an HF id, a local folder, or the bundled `base_model/`). `adapter_bytes`: PEFT's two files;
    `folder_bytes`: the whole folder (tokenizer, a bundled base). `max_abs_diff`: the verification's largest
    absolute difference to our embeddings.
    """

    folder: Path
    method: str
    exact: bool
    limitations: list[str]
    base_model: str
    pooling: dict[str, Any]
    adapter_bytes: int
    folder_bytes: int
    max_abs_diff: float
    modules_to_save: list[str] = field(default_factory=list)

    @property
    def limitation_codes(self) -> list[str]:
        return [line.split(":", 1)[0] for line in self.limitations]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["folder"] = str(self.folder)
        return d


# ------------------------------------------------------------------------------------------------ our side
@torch.inference_mode()
def reference_embeddings(model: CSEModel, sentences: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """Our evaluation embeddings `(N, d)` of `sentences`: the model's `token_ids` (templates included), right-padded
    per batch, `model.embed` — what the evaluator computes."""
    device = model.device
    ids = model.token_ids(list(sentences))
    out = []
    for i in range(0, len(ids), batch_size):
        input_ids, mask = pad_sequences(ids[i : i + batch_size], model.pad_token_id)
        out.append(model.embed(input_ids.to(device), mask.to(device)).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, model.hidden_size)


def adapter_plan(model: CSEModel) -> PeftPlan:
    """Map a loaded model onto PEFT: the part every prompted model shares, completed by its class's `peft_plan`
    (models/<method>.py). Raises `PeftExportError` for a method with no adapter and for what no adapter can carry."""
    if not type(model).exports_peft_adapter:
        raise PeftExportError(
            f"method {model.method!r} has no prompts to export as a PEFT prefix adapter; use cse.models.export.st_export"
        )
    prompted = cast("PromptedMethod", model)  # every method that exports an adapter is prompted
    enc, backbone = prompted.encoder, prompted.backbone
    arch = type(backbone).__name__
    if "past_key_values" not in inspect.signature(type(backbone).forward).parameters:
        raise PeftExportError(
            f"{arch}: its forward takes no past_key_values, so PEFT prefix tuning cannot inject "
            "prefixes into it; keep cse.models.export.st_export for this backbone"
        )
    if getattr(backbone.config, "is_encoder_decoder", False):
        raise PeftExportError(f"{arch} is an encoder-decoder; only encoder-only backbones are exported")

    plan = PeftPlan(pooling={"kind": "cls"})
    if not enc.shift_positions:
        plan.inexact.append(
            "position-shift: trained with shift_positions=False (token positions from 0); under a PEFT prefix cache "
            f"transformers numbers positions from P={prompted.prompts.prefix_len} (BERT) or padding_idx+1+P "
            "(RoBERTa) and PEFT adds P to explicit position_ids, so every embedding differs"
        )
    if prompted.prompts.transform is not None:
        plan.notes.append(
            "prefix-projection: the reparametrisation MLP (Embedding -> Linear -> tanh -> Linear) is "
            "stored as its P x 2*L*d output, PEFT's inference form; the MLP itself is not exported"
        )
    plan.notes.append(
        "inference-only: PEFT loads prompt-learning adapters for inference only (is_trainable=True is "
        "refused); prefix dropout and the training-only heads are not in the adapter"
    )
    plan.notes.append(
        "token-type-ids: PEFT drops token_type_ids (all-zero segments); equal for single sentences, "
        "which is how every embedding here is computed"
    )
    completed = model.peft_plan(plan)
    if completed is None:
        raise PeftExportError(f"{type(model).__name__}.peft_plan returned no plan")
    return completed


def carry_plan(base: PreTrainedModel, model: PromptedMethod, plan: PeftPlan) -> list[str]:
    """Edit the stock encoder `base` so that it carries what `plan` folds into it: the supervised cls MLP as its
    pooler, the [CLS] prompt in a position-embedding row. Returns the names of the edited `base` tensors.

    Args:
        base: the stock encoder (pretrained, or holding the fine-tuned weights).
        model: the loaded checkpoint model the plan was made from.
        plan: `adapter_plan(model)`.
    """
    edited = []
    with torch.no_grad():
        if plan.pooler_mlp is not None:
            if getattr(base, "pooler", None) is None or not hasattr(base.pooler, "dense"):
                raise PeftExportError(f"{type(base).__name__} has no pooler with a dense layer to carry the cls MLP")
            dense = cast(nn.Linear, base.get_submodule("pooler.dense"))  # HF poolers: dense (Linear) + tanh
            mlp_dense = cast(nn.Linear, plan.pooler_mlp.get_submodule("dense"))  # PeftPlan.pooler_mlp: a dense Linear
            dense.weight.copy_(mlp_dense.weight)
            dense.bias.copy_(mlp_dense.bias)
            edited += ["pooler.dense.weight", "pooler.dense.bias"]
        if plan.cls_fold is not None:
            row, cls_id = plan.cls_fold
            table = cast(nn.Embedding, base.get_submodule("embeddings.position_embeddings")).weight
            words = cast(nn.Embedding, base.get_submodule("embeddings.word_embeddings")).weight
            assert model.cls_prompt is not None  # a cls_fold is D2CSE's [CLS] prompt (D2CSE.peft_plan)
            table[row] += model.cls_prompt.to(table.dtype) - words[cls_id]
            edited.append("embeddings.position_embeddings.weight")
    return edited


def _sentence_transformers_note(pooling: dict[str, Any]) -> str:
    head = (
        "sentence-transformers: SentenceTransformer.load_adapter (transformers' PeftAdapterMixin) refuses "
        "prompt-learning adapters (peft inject_adapter_in_model: 'does not support prompt learning'); "
    )
    if pooling["kind"] == "cls":
        return (
            head + "wrap the Transformer module's model instead: st[0].model = PeftModel.from_pretrained(st[0].model, "
            "adapter_dir), with Pooling(d, 'cls')"
        )
    if pooling["kind"] == "pooler_output":
        return (
            head + "the wrap route st[0].model = PeftModel.from_pretrained(...) needs CLS pooling plus a Dense(d, d, "
            "tanh) copy of the carried pooler; peft_embed.py is the direct route"
        )
    return head + "the prompt template has no sentence-transformers equivalent; use peft_embed.py"


# ------------------------------------------------------------------------------------------------ export
def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def backbone_changed(trained: nn.Module, fresh: nn.Module) -> bool:
    """Whether the checkpoint's encoder weights differ from the pretrained ones (a method that fine-tunes it)."""
    fresh_state = fresh.state_dict()
    for name, tensor in trained.state_dict().items():
        other = fresh_state.get(name)
        if other is None or other.shape != tensor.shape or not torch.equal(other, tensor.to(other.dtype)):
            return True
    return False


def export_peft_adapter(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    allow_inexact: bool = False,
    probe_sentences: tuple[str, ...] = PROBE_SENTENCES,
) -> PeftExport:
    """Write `checkpoint_dir` (a checkpoint of a method whose model class defines `peft_plan`: D2CSE, DCPCSE, DiffAug)
    as a PEFT prefix-tuning adapter in `out_dir`.

    The adapter is loaded back with stock transformers + peft (`cse.models.export.peft_loader`) and compared with our `embed`
    on `probe_sentences`; a difference above `TOLERANCE`, or a feature PEFT cannot express, raises `PeftExportError`
    unless `allow_inexact=True` (then the folder is written with `exact=False` and the reason in `limitations`). An
    earlier `out_dir` is replaced only once the new export has passed; an `out_dir` that is, holds or lies inside the
    checkpoint folder is refused."""
    from cse.models.loading import load_encoder, resolve_model_path

    out, model, plan = _load_for_export(checkpoint_dir, out_dir, allow_inexact)
    prompts = model.prompts
    backbone_id = resolve_model_path(model.config.backbone)
    base = load_encoder(backbone_id).eval()
    with atomic_dir(out) as tmp:  # the old adapter is replaced only once the new one is complete and verified
        base_ref = backbone_id
        notes = list(plan.notes)
        if backbone_changed(model.backbone, base):
            base_ref = str(out / peft_loader.BUNDLED_BASE)
            notes.append(_bundle_fine_tuned_base(base, model, tmp, checkpoint_dir, backbone_id))
        carry_plan(base, model, plan)  # carried modules are edited on the base before wrapping: PEFT copies them
        _write_adapter(base, prompts, plan, base_ref, tmp)
        model.tokenizer.save_pretrained(tmp)
        shutil.copyfile(Path(peft_loader.__file__), tmp / LOADER_FILE)
        notes.append(_sentence_transformers_note(plan.pooling))

        # verification with the stock libraries, exactly as a user loads the folder
        spec, diff = _verify_adapter(tmp, model, plan, list(probe_sentences), allow_inexact, checkpoint_dir)
        exact = not plan.inexact
        limitations = plan.inexact + notes
        spec.update(
            exact=exact,
            max_abs_diff=diff,
            probe_sentences=len(probe_sentences),
            tolerance=TOLERANCE,
            base_model=base_ref,
            bundled_base=base_ref != backbone_id,
            modules_to_save=plan.modules_to_save,
            limitations=limitations,
            prefix_len=prompts.prefix_len,
            trained_shift_positions=bool(model.encoder.shift_positions),
        )
        (tmp / peft_loader.SPEC_FILE).write_text(json.dumps(spec, indent=2))
    adapter_bytes = sum((out / name).stat().st_size for name in ("adapter_config.json", "adapter_model.safetensors"))
    return PeftExport(
        folder=out,
        method=model.method,
        exact=exact,
        limitations=limitations,
        base_model=base_ref,
        pooling=plan.pooling,
        adapter_bytes=adapter_bytes,
        folder_bytes=_folder_bytes(out),
        max_abs_diff=diff,
        modules_to_save=list(plan.modules_to_save),
    )


def _load_for_export(
    checkpoint_dir: str | Path, out_dir: str | Path, allow_inexact: bool
) -> tuple[Path, PromptedMethod, PeftPlan]:
    """`out_dir` resolved, the checkpoint's model and its `adapter_plan`, once `out_dir` is known not to overlap the
    checkpoint folder, the checkpoint to be whole and of a method that exports an adapter (named before anything is
    loaded) and the plan to be exact unless `allow_inexact`; `ValueError`, `PeftExportError` otherwise."""
    from cse.models.checkpoint import load_checkpoint, model_class_of, validate_checkpoint

    out, source = Path(out_dir).resolve(), Path(checkpoint_dir).resolve()
    if out == source or out in source.parents or source in out.parents:
        raise ValueError(
            f"exporting to {out_dir} would overwrite the checkpoint {checkpoint_dir}: choose another folder"
        )
    meta = validate_checkpoint(checkpoint_dir)  # a missing or damaged checkpoint is named before anything is loaded
    if not model_class_of(meta["method"]).exports_peft_adapter:
        raise PeftExportError(
            f"{checkpoint_dir}: method {meta['method']!r} has no prompts to export as a PEFT prefix "
            "adapter (its model class defines no peft_plan); use cse.models.export.st_export"
        )
    model = cast("PromptedMethod", load_checkpoint(checkpoint_dir))  # a method with prompts (checked above)
    plan = adapter_plan(model)
    if plan.inexact and not allow_inexact:
        raise PeftExportError(
            f"{checkpoint_dir}: a PEFT prefix adapter cannot reproduce this model exactly: "
            + " | ".join(plan.inexact)
            + " (allow_inexact=True writes it marked inexact; "
            "cse.models.export.st_export keeps the exact model)"
        )
    return out, model, plan


def _bundle_fine_tuned_base(
    base: PreTrainedModel, model: PromptedMethod, tmp: Path, checkpoint_dir: str | Path, backbone_id: str
) -> str:
    """Load the checkpoint's fine-tuned encoder into `base` and write it with the tokenizer as the export's
    `base_model/` (in the temporary folder `tmp`); returns the note that says so."""
    missing, unexpected = base.load_state_dict(model.backbone.state_dict(), strict=False)
    if unexpected or any(not k.startswith("pooler.") for k in missing):
        raise PeftExportError(
            f"{checkpoint_dir}: the fine-tuned encoder does not fit {backbone_id} "
            f"(unexpected {unexpected[:5]}, missing {missing[:5]})"
        )
    base.save_pretrained(tmp / peft_loader.BUNDLED_BASE)
    model.tokenizer.save_pretrained(tmp / peft_loader.BUNDLED_BASE)
    size = _folder_bytes(tmp / peft_loader.BUNDLED_BASE)
    return (
        f"fine-tuned-base: {model.method} fine-tunes its encoder, so the adapter's base is the "
        f"fine-tuned encoder bundled in {peft_loader.BUNDLED_BASE}/ ({size / 1e6:.1f} MB), not "
        f"{model.config.backbone}; the prefixes on the pretrained encoder do not give these embeddings"
    )


def _write_adapter(base: PreTrainedModel, prompts: PrefixEncoder, plan: PeftPlan, base_ref: str, tmp: Path) -> None:
    """PEFT's own files in `tmp`: `base` wrapped by a prefix-tuning config of `prompts`' shape (base model
    `base_ref`), its prompt table set to the prompts' `P × 2·L·d` rows, saved without PEFT's README."""
    from peft import PrefixTuningConfig, TaskType, get_peft_model

    cfg = base.config
    peft_config = PrefixTuningConfig(
        task_type=TaskType.FEATURE_EXTRACTION,
        num_virtual_tokens=prompts.prefix_len,
        token_dim=cfg.hidden_size,
        num_layers=prompts.num_layers,
        num_attention_heads=prompts.num_heads,
        num_transformer_submodules=1,
        encoder_hidden_size=cfg.hidden_size,
        prefix_projection=False,
        modules_to_save=plan.modules_to_save or None,
    )
    peft_model = get_peft_model(base, peft_config)
    peft_model.peft_config["default"].base_model_name_or_path = base_ref
    table = cast(nn.Embedding, peft_model.prompt_encoder["default"].get_submodule("embedding"))  # PrefixEncoder's
    with torch.no_grad():
        table.weight.copy_(prompts.rows().detach())
    peft_model.save_pretrained(str(tmp), save_embedding_layers=False)
    (tmp / "README.md").unlink(missing_ok=True)  # PEFT's own card: the job's model card is written instead


def _verify_adapter(
    tmp: Path,
    model: PromptedMethod,
    plan: PeftPlan,
    sentences: list[str],
    allow_inexact: bool,
    checkpoint_dir: str | Path,
) -> tuple[dict[str, Any], float]:
    """Write the spec file, load the folder `tmp` back with the stock libraries and compare its embeddings of
    `sentences` with ours: above `TOLERANCE` a `PeftExportError`, or with `allow_inexact` a note in `plan.inexact`.
    Returns the spec as loaded and the largest absolute difference."""
    spec = {
        "format_version": FORMAT_VERSION,
        "method": model.method,
        "backbone": model.config.backbone,
        "pooling": plan.pooling,
    }
    (tmp / peft_loader.SPEC_FILE).write_text(json.dumps(spec, indent=2))
    loaded, tokenizer, spec = peft_loader.load_prefix_encoder(tmp)
    diff = (
        float(
            (peft_loader.embed_sentences(loaded, tokenizer, spec, sentences) - reference_embeddings(model, sentences))
            .abs()
            .max()
        )
        if sentences
        else 0.0
    )
    if diff > TOLERANCE:
        if not allow_inexact:
            raise PeftExportError(
                f"{checkpoint_dir}: the PEFT adapter's embeddings differ from ours by {diff:.3g} "
                f"(> {TOLERANCE}) on the probe sentences"
            )
        plan.inexact.append(f"verification: embeddings differ from ours by up to {diff:.3g} on the probe sentences")
    return spec, diff
