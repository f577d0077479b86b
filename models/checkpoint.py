"""Checkpoints of any method: trainable tensors only, the frozen backbone by reference.

A checkpoint folder holds
  `cse_model.json`       method, backbone name/path, the pretrained backbone's shape and weight fingerprint, the
                         full model config, the evaluation pooler and caller metadata;
  `weights.safetensors`  every parameter outside the frozen pretrained backbone (trainable ones, and prompts frozen by
                         `train_prompts=False`) plus the persistent buffers outside the frozen parameters
                         (BatchNorm running statistics), minus the model's `not_for_inference` prefixes — a few MB
                         for the prompt methods (D2CSE, DCPCSE) on BERT-base, one encoder (~440 MB) for the
                         fine-tuning methods (SimCSE, DiffCSE without its discriminator, DiffAug).
`load_checkpoint` rebuilds the backbone from its name/path (`cse.models.loading.load_encoder`), refuses one whose
shape or weights differ, and returns the model in eval mode (the evaluable-model contract: `tokenizer`
attribute and `embed(input_ids, attention_mask, token_type_ids=None)`).
"""

from __future__ import annotations

import importlib
import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cse.models.embedder import CHECKPOINT_CONFIG, CHECKPOINT_WEIGHTS, CheckpointMismatchError, SentenceEmbedder
from cse.models.loading import resolve_model_path
from cse.models.method import SHAPE_KEYS, CSEModel, backbone_fingerprint, backbone_shape
from cse.storage.atomic import atomic_file

META_FILE = "cse_model.json"
WEIGHTS_FILE = "weights.safetensors"
FORMAT_VERSION = 1


class BackboneMismatchError(ValueError):
    """The backbone found at load time is not the one the checkpoint was trained on."""


class CheckpointError(ValueError):
    """A checkpoint folder or one of its files is missing or damaged; the message names the file and what is wrong."""


_REQUIRED_META = ("format_version", "method", "backbone", "backbone_shape", "backbone_fingerprint", "model_config")
_SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own limit


def _check_safetensors(path: Path) -> list[str]:
    """The tensor names in a safetensors file, after checking its layout (header length, header JSON, every tensor's
    byte range inside the file, nothing missing at the end) without reading the data."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (every checkpoint holds its weights there)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length"
            )
        (n,) = struct.unpack("<Q", head)
        if n > _SAFETENSORS_MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file: its header claims {n:,d} bytes, the file has {size:,d}"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: damaged safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: damaged safetensors header (a {type(header).__name__}, not an object)")
    data_len, names = size - 8 - n, []
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: damaged safetensors header: tensor {name!r} has no data_offsets") from None
        if not 0 <= lo <= hi <= data_len:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes {lo:,d}-{hi:,d} of the data, the file "
                f"holds {data_len:,d}"
            )
        end = max(end, hi)
        names.append(name)
    if end != data_len:
        raise CheckpointError(f"{path}: damaged: {data_len:,d} data bytes, the header describes {end:,d}")
    return names


def validate_checkpoint(folder: str | Path) -> dict[str, Any]:
    """Check a checkpoint folder before anything is loaded (no backbone, no tensor data): the folder,
    `cse_model.json` (JSON, required keys, format) and `weights.safetensors` (layout, and the tensors the metadata
    lists). Returns the metadata; raises `CheckpointError` / `FileNotFoundError` naming the file and what is wrong."""
    folder = Path(folder)
    if not str(folder).strip() or not folder.is_dir():
        raise FileNotFoundError(
            f"checkpoint folder {str(folder)!r} does not exist (expected a folder holding {META_FILE} "
            f"and {WEIGHTS_FILE})"
        )
    meta = read_checkpoint_meta(folder)
    path = folder / META_FILE
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found a {type(meta).__name__}")
    if missing := [k for k in _REQUIRED_META if k not in meta]:
        raise CheckpointError(f"{path}: lacks the keys {missing} (not a checkpoint written by this project?)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format_version')} (this code reads {FORMAT_VERSION})"
        )
    names = set(_check_safetensors(folder / WEIGHTS_FILE))
    if absent := sorted(set(meta.get("tensors", ())) - names):
        raise CheckpointError(f"{folder / WEIGHTS_FILE}: lacks tensors that {META_FILE} lists: {absent[:5]}")
    return meta


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """The parameters a checkpoint leaves out: the frozen ones of the pretrained backbone (`model.backbone`), which
    loading rebuilds from the backbone's name. A frozen tensor outside it (prompts frozen at their random initial
    values, `train_prompts=False`) cannot be rebuilt, so it is saved like a trainable one."""
    backbone = getattr(model, "backbone", None)
    pretrained = {id(p) for p in backbone.parameters()} if isinstance(backbone, nn.Module) else None
    return {
        n for n, p in model.named_parameters() if not p.requires_grad and (pretrained is None or id(p) in pretrained)
    }


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the frozen backbone parameters: trainable tensors, frozen non-backbone tensors (frozen
    prompts) and persistent buffers (BN statistics)."""
    frozen = frozen_parameter_names(model)
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in frozen}


def save_checkpoint(model: CSEModel, folder: str | Path, extra_meta: dict[str, Any] | None = None) -> Path:
    """Write `cse_model.json` + `weights.safetensors` into `folder` (created; existing files replaced)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    skip = tuple(getattr(model, "not_for_inference", ()))
    state = {k: v for k, v in trainable_state_dict(model).items() if not k.startswith(skip)}
    meta = {
        "format_version": FORMAT_VERSION,
        "method": model.method,
        "backbone": model.config.backbone,
        "backbone_shape": model.pretrained_shape,
        "backbone_fingerprint": model.pretrained_fingerprint,
        "model_config": model.config.to_dict(),
        "pooler": model.evaluation_pooler,
        "embedding_dim": model.hidden_size,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "tensors": sorted(state),
        "not_for_inference": list(skip),
        "meta": dict(extra_meta or {}),
    }
    with atomic_file(folder / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    with atomic_file(folder / META_FILE) as tmp:
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    return folder


def read_checkpoint_meta(folder: str | Path) -> dict[str, Any]:
    """Read the metadata JSON of a checkpoint folder.

    Args:
        folder: the checkpoint folder.

    Returns:
        The metadata as a dict.

    Raises:
        FileNotFoundError: the folder has no metadata file.
        CheckpointError: the metadata file is not valid UTF-8 JSON.
    """
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint: {path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: damaged: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: damaged: not valid JSON at line {e.lineno} column {e.colno} ({e.msg})"
        ) from None


def model_class_of(method: str) -> type[CSEModel]:
    """The model class of a checkpoint's method: the `CSEModel` subclass named for it in `models/methods/<method>.py`
    (the layout config/methods.py's registry entries follow; a test checks every entry does)."""
    if not method.isidentifier():
        raise CheckpointError(f"checkpoint names method {method!r}, not a method name")
    try:
        module = importlib.import_module(f"cse.models.methods.{method}")
    except ModuleNotFoundError:
        raise CheckpointError(f"checkpoint names method {method!r}: no module models/methods/{method}.py") from None
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, CSEModel) and getattr(value, "method", None) == method:
            return value
    raise CheckpointError(f"models/methods/{method}.py has no CSEModel subclass with method = {method!r}")


def load_checkpoint(
    folder: str | Path, device: str | torch.device = "cpu", backbone_override: str | None = None
) -> CSEModel:
    """Rebuild the model of a checkpoint folder in eval mode on `device`.

    `backbone_override`: another name/path of the same backbone (e.g. a local copy); it must match the
    recorded shape and fingerprint, otherwise `BackboneMismatchError`.
    """
    from cse.models.loading import load_encoder, load_tokenizer

    folder = Path(folder)
    meta = validate_checkpoint(folder)  # before the backbone is loaded: a damaged file is named at once
    cls = model_class_of(meta.get("method", "?"))
    config = cls.config_class.from_dict(meta["model_config"])
    if backbone_override is not None:
        config = replace(config, backbone=backbone_override)

    backbone = load_encoder(config.backbone)
    found = backbone_shape(backbone)
    expected = meta["backbone_shape"]
    diff = {k: (expected.get(k), found.get(k)) for k in SHAPE_KEYS if expected.get(k) != found.get(k)}
    if diff:
        raise BackboneMismatchError(
            f"checkpoint {folder} was trained on {meta['backbone']!r}; backbone {config.backbone!r} differs in "
            + ", ".join(f"{k} (checkpoint {a}, found {b})" for k, (a, b) in diff.items())
        )
    if backbone_fingerprint(backbone) != meta["backbone_fingerprint"]:
        raise BackboneMismatchError(
            f"checkpoint {folder} was trained on {meta['backbone']!r}; backbone {config.backbone!r} has the same shape "
            "but different weights (fingerprint mismatch)"
        )

    model = cls(config, backbone=backbone, tokenizer=load_tokenizer(config.backbone))
    state = load_file(str(folder / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    skipped = tuple(meta.get("not_for_inference", ()))
    not_frozen = sorted(k for k in set(missing) - frozen_parameter_names(model) if not k.startswith(skipped))
    if unexpected or not_frozen:
        raise ValueError(
            f"{folder}: weights do not fit the model (unexpected {unexpected[:5]}, missing {not_frozen[:5]})"
        )
    return model.to(device).eval()


def read_checkpoint_config(folder: str | Path) -> dict[str, Any]:
    """`cse_model.json` of a checkpoint folder (method, backbone, pooler, ...)."""
    folder = Path(folder)
    cfg_path = folder / CHECKPOINT_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a checkpoint folder: expected {CHECKPOINT_CONFIG} (and {CHECKPOINT_WEIGHTS})"
        )
    if not (folder / CHECKPOINT_WEIGHTS).is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {CHECKPOINT_WEIGHTS}")
    cfg = validate_checkpoint(folder)  # JSON (method, backbone...) and the safetensors layout; errors name the file
    if "pooler" not in cfg:
        raise ValueError(f"{cfg_path} lacks the key 'pooler'")
    return cfg


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return resolve_model_path(a) == resolve_model_path(b)
    except (ImportError, FileNotFoundError):
        return False


def load_checkpoint_folder(
    folder: str | Path,
    device: str | torch.device = "cpu",
    *,
    expect_backbone: str | None = None,
    expect_pooler: str | None = None,
) -> SentenceEmbedder:
    """A training run's checkpoint folder → its embedder (via `load_checkpoint`).

    `expect_pooler`, when given, must equal the checkpoint's pooler. `expect_backbone`, when given and
    named differently from the checkpoint's backbone, is loaded instead of it (e.g. a local copy) and
    `load_checkpoint` refuses it unless its shape and weights match the recorded ones.
    """
    cfg = read_checkpoint_config(folder)
    if expect_pooler is not None and expect_pooler != cfg["pooler"]:
        raise CheckpointMismatchError(
            f"checkpoint {folder} evaluates with pooler {cfg['pooler']!r}, not {expect_pooler!r} "
            "(SimCSE's evaluation.py: a checkpoint must be evaluated with its own pooler)"
        )
    if expect_backbone is not None and not _same_model(expect_backbone, cfg["backbone"]):
        emb = load_checkpoint(Path(folder), torch.device(device), backbone_override=expect_backbone)
    else:
        emb = load_checkpoint(Path(folder), torch.device(device))
    if not isinstance(emb, SentenceEmbedder):
        raise TypeError(f"load_checkpoint returned {type(emb).__name__}, not a SentenceEmbedder")
    return emb.eval()
