"""Export a trained checkpoint as a sentence-transformers model folder.

`export_portable_sentence_transformer` (what a training job's export stage writes) makes a folder that loads with
sentence-transformers, torch and transformers alone, without this project:
- `standard`: a fully trained encoder read by a standard pooler (SimCSE, DiffCSE): stock Transformer + Pooling
  (+ Dense) modules (models/export/st_standard.py), loaded without `trust_remote_code`;
- `bundled-code`: a prompt method (D2CSE, DCPCSE, DiffAug) whose prompts PEFT's prefix layout holds exactly
  (models/export/peft_export.py's `adapter_plan`): `cse_prompted_encoder.py` (a copy of models/export/st_prompted.py, importing
  nothing from this project) + the prefix rows + the base encoder (bundled, or its hub id), loaded with
  `trust_remote_code=True`;
- `project`: anything else (a prefix layout the stock model cannot take, a pooler with no standard equivalent):
  `PromptedEncoderModule` (below) over the checkpoint, which needs this project importable; the reason is recorded.
Every portable folder is checked against the training code's embeddings before it replaces an earlier one.

`export_sentence_transformer` writes the `project` form directly: `modules.json` naming `PromptedEncoderModule`, the
checkpoint (backbone reference + prompt/pooler weights, a few MB) and the tokenizer; load it with
`SentenceTransformer(folder, trust_remote_code=True)` where this package is installed.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, cast

import torch
from sentence_transformers.base.modules import InputModule
from transformers import PreTrainedTokenizerBase

from cse.storage.atomic import atomic_dir, remove_path

if TYPE_CHECKING:
    from cse.models.export import st_prompted
    from cse.models.export.peft_export import PromptedMethod
    from cse.models.method import CSEModel

CHECKPOINT_SUBDIR = "checkpoint"
TOLERANCE = 1e-5  # a portable folder must reproduce the training code's embeddings this closely


class PromptedEncoderModule(InputModule):
    """Tokenise, run the frozen backbone with the trained prompts, return the evaluation embedding."""

    config_keys = ["max_seq_length"]
    save_in_root = True
    tokenizer: PreTrainedTokenizerBase  # the checkpoint's (InputModule also allows a `tokenizers` one)

    def __init__(self, checkpoint_dir: str | Path, max_seq_length: int | None = None) -> None:
        super().__init__()
        from cse.models.checkpoint import load_checkpoint
        from cse.models.loading import load_tokenizer

        self.checkpoint_dir = Path(checkpoint_dir)
        self.encoder = load_checkpoint(self.checkpoint_dir, device="cpu")
        meta = json.loads((self.checkpoint_dir / "cse_model.json").read_text())
        self.tokenizer = getattr(self.encoder, "tokenizer", None) or load_tokenizer(meta["backbone"])
        self.max_seq_length = max_seq_length

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
        texts = [str(t) for t in inputs]
        if prompt:
            texts = [prompt + t for t in texts]
        return self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_seq_length is not None,
            max_length=self.max_seq_length,
            return_tensors="pt",
        )

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        features["sentence_embedding"] = self.encoder.embed(
            features["input_ids"], features["attention_mask"], features.get("token_type_ids")
        )
        return features

    def get_sentence_embedding_dimension(self) -> int:
        with torch.inference_mode():
            enc = self.preprocess(["a"])
            return int(self.encoder.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids")).shape[-1])

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        out = Path(output_path)
        if (out / CHECKPOINT_SUBDIR).resolve() != self.checkpoint_dir.resolve():
            shutil.copytree(self.checkpoint_dir, out / CHECKPOINT_SUBDIR, dirs_exist_ok=True)
        self.save_config(output_path)
        self.save_tokenizer(output_path)

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        init_defaults: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Self:
        config = cls.load_config(model_name_or_path, subfolder=subfolder)
        return cls(Path(model_name_or_path) / subfolder / CHECKPOINT_SUBDIR, **config)


def export_sentence_transformer(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a folder that `SentenceTransformer(out_dir, trust_remote_code=True)` loads.

    An earlier `out_dir` is replaced as a whole once the new folder is complete (`cse.storage.atomic.atomic_dir`);
    an `out_dir` that is, holds or lies inside the checkpoint folder is refused."""
    out = Path(out_dir)
    _refuse_overlap(checkpoint_dir, out)
    module = PromptedEncoderModule(checkpoint_dir)  # a missing or damaged checkpoint fails before anything is written
    with atomic_dir(out) as tmp:
        _save_project_module(module, tmp)
    return out


def _empty(folder: Path) -> None:
    for p in folder.iterdir():
        remove_path(p)


def _save_project_module(module: PromptedEncoderModule, folder: Path) -> None:
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(modules=[module]).save(str(folder), create_model_card=False)  # the card: cse.tracking


def _refuse_overlap(checkpoint_dir: str | Path, out: Path) -> None:
    source = Path(checkpoint_dir).resolve()
    if out.resolve() == source or out.resolve() in source.parents or source in out.resolve().parents:
        raise ValueError(f"exporting to {out} would overwrite the checkpoint {checkpoint_dir}: choose another folder")


# ------------------------------------------------------------------------------------------------ portable export
@dataclass(frozen=True)
class STExport:
    """What `export_portable_sentence_transformer` wrote: the folder, its kind (`standard`, `bundled-code` or
    `project`), why that kind, and the largest difference to the training code's embeddings on the probe sentences
    (None: not measured, `project`)."""

    folder: Path
    kind: str
    reason: str
    max_abs_diff: float | None = None

    @property
    def trust_remote_code(self) -> bool:
        """Whether `SentenceTransformer(folder, ...)` needs `trust_remote_code=True`."""
        return self.kind != "standard"


def export_kind(folder: str | Path) -> STExport | None:
    """The kind of an existing export folder, read from its `modules.json` (None: no such file, or no module)."""
    path = Path(folder) / "modules.json"
    if not path.is_file():
        return None
    from cse.models.export import st_prompted

    types = [m.get("type", "") for m in json.loads(path.read_text(encoding="utf-8"))]
    if not types:
        return None
    if all(t.startswith("sentence_transformers.") for t in types):
        return STExport(Path(folder), "standard", "stock sentence-transformers modules")
    if types == [st_prompted.CLASS_REF]:
        return STExport(Path(folder), "bundled-code", f"the module's code ships as {st_prompted.CODE_FILE}")
    return STExport(Path(folder), "project", f"modules.json names {types}")


def export_portable_sentence_transformer(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    probe_sentences: tuple[str, ...] | None = None,
    bundle_base: bool | None = None,
) -> STExport:
    """Write `checkpoint_dir` as a sentence-transformers folder that loads without this project where possible
    (the kinds: see the module docstring); else the `project` form, with the reason.

    Args:
        checkpoint_dir: a checkpoint folder (models/checkpoint.py).
        out_dir: the export folder; an earlier one is replaced only once the new export is written and checked. An
            `out_dir` that is, holds or lies inside the checkpoint folder is refused.
        probe_sentences: the sentences the `bundled-code` form is checked on (default: the PEFT export's probes).
        bundle_base: whether the `bundled-code` form carries its base encoder (`encoder/`); None: when the backbone is
            a local folder (the packaged MiniLM too) or was fine-tuned; False: name the pretrained backbone by its id
            (or path), which must then be reachable where the folder is loaded (not for a fine-tuned encoder).

    Returns:
        The `STExport` written.
    """
    from cse.models.checkpoint import load_checkpoint, model_class_of, validate_checkpoint
    from cse.models.export.st_standard import standard_sentence_transformer

    out = Path(out_dir)
    _refuse_overlap(checkpoint_dir, out)
    meta = validate_checkpoint(checkpoint_dir)  # a missing or damaged checkpoint fails before anything is removed
    with atomic_dir(out) as tmp:  # the old export is replaced only once the new one is complete
        result, why = None, ""
        if model_class_of(meta["method"]).exports_peft_adapter:  # prompts: the stock model with a prefix cache
            model = load_checkpoint(checkpoint_dir, device="cpu")
            diff, why = _write_prompted(model, tmp, probe_sentences, bundle_base)
            if diff is not None:
                result = STExport(out, "bundled-code", why, diff)
        if result is None:
            with tempfile.TemporaryDirectory(prefix="cse-st-") as workdir:
                st, why_not = standard_sentence_transformer(checkpoint_dir, workdir)
                if st is not None:
                    st.save(str(tmp), create_model_card=False)
                    result = STExport(out, "standard", why_not)
                why = f"{why}; {why_not}" if why else why_not
        if result is None:
            _empty(tmp)  # what a form that did not pass left
            _save_project_module(PromptedEncoderModule(checkpoint_dir), tmp)
            result = STExport(out, "project", why)
    return result


def _write_prompted(
    model: CSEModel, folder: Path, probe_sentences: tuple[str, ...] | None, bundle_base: bool | None
) -> tuple[float | None, str]:
    """Write a prompt method's model as the `bundled-code` form into `folder` and check it against `model.embed`.

    Returns `(largest difference, reason)`; `(None, why)` with `folder` emptied when the form cannot hold the model
    exactly (what PEFT's prefix layout cannot express, or a check above `TOLERANCE`)."""
    from sentence_transformers import SentenceTransformer

    from cse.models.export import st_prompted
    from cse.models.export.peft_export import PROBE_SENTENCES, PeftExportError, reference_embeddings

    try:
        module, bundled, backbone_id = _prompted_module(model, bundle_base)
    except PeftExportError as e:
        return None, str(e)
    st = SentenceTransformer(modules=[module], device="cpu")
    st.save(str(folder), create_model_card=False)
    (folder / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": st_prompted.CLASS_REF}], indent=2), encoding="utf-8"
    )
    # the check: the folder as a user loads it (its own files, this module's code) against the training code
    loaded = SentenceTransformer(modules=[st_prompted.PromptedEncoder.load(str(folder))], device="cpu")
    sentences = list(probe_sentences if probe_sentences is not None else PROBE_SENTENCES)
    got = loaded.encode(sentences, convert_to_tensor=True, batch_size=64).float().cpu()
    diff = float((got - reference_embeddings(model, sentences)).abs().max()) if sentences else 0.0
    if diff > TOLERANCE:
        _empty(folder)
        return None, f"the bundled module differs from the training code's embeddings by {diff:.3g} (> {TOLERANCE})"
    where = "the bundled encoder" if bundled else f"the hub encoder {backbone_id}"
    return diff, f"{model.method}: prefixes on {where}, checked within {TOLERANCE} (largest difference {diff:.2g})"


def _prompted_module(model: CSEModel, bundle_base: bool | None) -> tuple[st_prompted.PromptedEncoder, bool, str]:
    """The `bundled-code` module of a prompt method's model: the stock base encoder (the fine-tuned one where the
    method fine-tunes it) carrying what the PEFT plan folds into it, the prefix rows and the spec. Returns it, whether
    the base is bundled, and the base's hub id or folder; `PeftExportError` with the reason where the form cannot
    hold the model exactly."""
    from cse.models.export import st_prompted
    from cse.models.export.peft_export import PeftExportError, adapter_plan, backbone_changed, carry_plan
    from cse.models.loading import load_encoder, resolve_model_path

    plan = adapter_plan(model)
    if plan.inexact:
        raise PeftExportError("the stock model with a prefix cache cannot reproduce it: " + " | ".join(plan.inexact))
    prompted = cast("PromptedMethod", model)  # adapter_plan passed: a method on prompts
    backbone_id = resolve_model_path(model.config.backbone)
    base = load_encoder(backbone_id).eval()
    fine_tuned = backbone_changed(model.backbone, base)
    if fine_tuned:
        missing, unexpected = base.load_state_dict(model.backbone.state_dict(), strict=False)
        if unexpected or any(not k.startswith("pooler.") for k in missing):
            raise PeftExportError(f"the fine-tuned encoder does not fit {backbone_id} (unexpected {unexpected[:5]})")
    edited = carry_plan(base, prompted, plan)
    bundled = fine_tuned or (Path(backbone_id).exists() if bundle_base is None else bundle_base)
    prompts = prompted.prompts
    spec = {
        "format_version": 1,
        "method": model.method,
        "base_model": st_prompted.ENCODER_DIR if bundled else backbone_id,
        "prefix_len": prompts.prefix_len,
        "num_layers": prompts.num_layers,
        "num_heads": prompts.num_heads,
        "head_dim": int(prompts.rows().shape[1]) // (2 * prompts.num_layers * prompts.num_heads),
        "pooling": plan.pooling,
        "overrides": [] if bundled else edited,
    }
    module = st_prompted.PromptedEncoder(base, copy.deepcopy(model.tokenizer), prompts.rows().detach(), spec)
    return module, bundled, backbone_id
