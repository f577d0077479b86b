"""A sentence-transformers module for deep-prompt encoders that loads without this project.

`cse.models.export.st_export.export_sentence_transformer` copies this file into the export folder of a prompt method (D2CSE,
DCPCSE, DiffAug) as `cse_prompted_encoder.py` and names `cse_prompted_encoder.PromptedEncoder` in `modules.json`;
sentence-transformers (6.x) imports it from the folder when the folder is loaded with `trust_remote_code=True`:

    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer("path/to/export", trust_remote_code=True)

It therefore imports only torch, transformers, safetensors and sentence-transformers (a test checks its imports),
never this project. The folder holds, beside this file:

- `prompted_encoder.json`: the prefix shape (`prefix_len`, `num_layers`, `num_heads`, `head_dim`), the pooling
  (`cls`, `pooler_output`, or `mask` with the method's prompt template), the base encoder (`encoder`: the bundled
  folder, or an HF hub id) and `max_seq_length`;
- `prompted_encoder.safetensors`: `prefix`, the `P x 2*L*d` key/value rows (P-tuning v2 layout, PEFT's
  `prompt_embeddings`), and `base.<name>` tensors that replace the base encoder's own (a folded [CLS] prompt, a carried
  pooler) when the base is referenced by its hub id;
- `encoder/`: the base encoder as a transformers folder, when it is not a hub id or was fine-tuned (DiffAug);
- the tokenizer files.

The forward is the stock model with the prefix as its key/value cache, as PEFT prefix tuning runs it
(transformers 5.x): every self-attention layer prepends the layer's P prefix keys/values, the attention mask gets P
leading ones, and the token positions are numbered after the P cached slots (the HF 4.x shift the prompts were
trained with). `cse.models.export.st_export` checks this module against the training code's embeddings at export time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import torch
from safetensors.torch import load_file, save_file
from sentence_transformers.base.modules import InputModule
from transformers import AutoModel, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

CODE_FILE = "cse_prompted_encoder.py"
CLASS_REF = "cse_prompted_encoder.PromptedEncoder"
SPEC_FILE = "prompted_encoder.json"
WEIGHTS_FILE = "prompted_encoder.safetensors"
ENCODER_DIR = "encoder"
SENTENCE_PLACEHOLDER = "{sentence}"
POOLINGS = ("cls", "pooler_output", "mask")
_SPEC_KEYS = ("prefix_len", "num_layers", "num_heads", "head_dim", "pooling", "base_model")


class PromptedEncoder(InputModule):
    """Tokenise (the method's template, if any), run the base encoder with the trained prefixes, pool.

    Args:
        encoder: the base transformers encoder (its pooler kept: the `pooler_output` pooling reads it).
        tokenizer: its tokenizer (right padding).
        prefix: the `(P, 2*L*d)` prefix rows.
        spec: the contents of `prompted_encoder.json` (prefix shape, pooling, base model).
        max_seq_length: truncate token sequences to this length; None: no truncation (as in training).
    """

    config_keys = ["max_seq_length"]
    save_in_root = True
    tokenizer: PreTrainedTokenizerBase  # a transformers tokenizer (InputModule also allows a `tokenizers` one)

    def __init__(
        self,
        encoder: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        prefix: torch.Tensor,
        spec: dict[str, Any],
        max_seq_length: int | None = None,
    ) -> None:
        super().__init__()
        missing = [k for k in _SPEC_KEYS if k not in spec]
        if missing:
            raise ValueError(f"{SPEC_FILE}: missing keys {missing}")
        if spec["pooling"].get("kind") not in POOLINGS:
            raise ValueError(f"{SPEC_FILE}: pooling kind {spec['pooling'].get('kind')!r} is not one of {POOLINGS}")
        p, layers, heads, dim = (int(spec[k]) for k in ("prefix_len", "num_layers", "num_heads", "head_dim"))
        if tuple(prefix.shape) != (p, 2 * layers * heads * dim):
            raise ValueError(
                f"{WEIGHTS_FILE}: prefix of shape {tuple(prefix.shape)}, expected {(p, 2 * layers * heads * dim)}"
            )
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"
        self.prefix = torch.nn.Parameter(prefix.detach().clone(), requires_grad=False)
        self.spec = dict(spec)
        self.max_seq_length = max_seq_length

    # ------------------------------------------------------------------------------------------------ inference
    def texts(self, inputs: Sequence[Any], prompt: str | None = None) -> list[str]:
        """The texts the tokenizer sees: each sentence (after `prompt`), wrapped in the method's template if any."""
        texts = [(prompt or "") + str(t) for t in inputs]
        template = self.spec["pooling"].get("template")
        if template is None:
            return texts
        head, tail = template.split(SENTENCE_PLACEHOLDER)
        return [(head + t + tail).strip() for t in texts]

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(
            self.texts(inputs, prompt),
            padding=True,
            truncation=self.max_seq_length is not None,
            max_length=self.max_seq_length,
            return_tensors="pt",
        )
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def _cache(self, batch: int) -> DynamicCache:
        """The prefix as a key/value cache: per layer, keys and values of shape `(B, heads, P, head_dim)`."""
        p, layers, heads, dim = (int(self.spec[k]) for k in ("prefix_len", "num_layers", "num_heads", "head_dim"))
        dtype = next(self.encoder.parameters()).dtype
        rows = self.prefix.to(dtype).view(1, p, 2 * layers, heads, dim).expand(batch, -1, -1, -1, -1)
        per_layer = rows.permute(2, 0, 3, 1, 4).split(2)  # L x (2, B, heads, P, head_dim)
        return DynamicCache([(kv[0], kv[1]) for kv in per_layer])

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        ids, mask = features["input_ids"], features["attention_mask"]
        batch, p = ids.shape[0], int(self.spec["prefix_len"])
        full_mask = torch.cat([torch.ones(batch, p, dtype=mask.dtype, device=mask.device), mask], dim=1)
        out = self.encoder(input_ids=ids, attention_mask=full_mask, past_key_values=self._cache(batch))
        features["token_embeddings"] = out.last_hidden_state
        features["sentence_embedding"] = self.pool(out, ids, mask)
        return features

    def pool(self, output: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The sentence vectors `(B, d)`: first-token state, the (carried) pooler, or the template's last mask."""
        pooling = self.spec["pooling"]
        if pooling["kind"] == "cls":
            return output.last_hidden_state[:, 0]
        if pooling["kind"] == "pooler_output":
            if output.pooler_output is None:
                raise ValueError("pooling 'pooler_output' needs the base encoder's pooling layer")
            return output.pooler_output
        mask_id = int(pooling["mask_token_id"])
        is_mask = (input_ids == mask_id) & attention_mask.bool()
        if not bool(is_mask.any(dim=1).all()):
            raise ValueError(f"pooling 'mask': a row holds no mask token (id {mask_id}); a truncation cut it off?")
        last = input_ids.shape[1] - 1 - is_mask.flip(1).to(torch.int8).argmax(dim=1)
        return output.last_hidden_state[torch.arange(input_ids.shape[0], device=input_ids.device), last]

    def get_sentence_embedding_dimension(self) -> int:
        return int(self.encoder.config.hidden_size)

    # ------------------------------------------------------------------------------------------------ files
    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        out = Path(output_path)
        tensors = {"prefix": self.prefix.detach().contiguous().cpu()}
        if self.spec["base_model"] == ENCODER_DIR:
            self.encoder.save_pretrained(out / ENCODER_DIR)
        else:  # the hub encoder by reference: only the tensors that replace its own travel
            state = self.encoder.state_dict()
            tensors.update({f"base.{k}": state[k].detach().contiguous().cpu() for k in self.spec.get("overrides", [])})
        save_file(tensors, str(out / WEIGHTS_FILE))
        (out / SPEC_FILE).write_text(json.dumps(self.spec, indent=2, sort_keys=True), encoding="utf-8")
        self.save_config(output_path)
        self.save_tokenizer(output_path)
        code = Path(__file__).read_text(encoding="utf-8")
        (out / CODE_FILE).write_text(code, encoding="utf-8")

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
        hub: dict[str, Any] = dict(
            token=token, cache_folder=cache_folder, revision=revision, local_files_only=local_files_only
        )
        found = cls.load_dir_path(model_name_or_path, subfolder=subfolder, **hub)
        if found is None:
            raise FileNotFoundError(f"{model_name_or_path} (subfolder {subfolder!r}): no such model folder")
        folder = Path(found)
        config = cls.load_config(model_name_or_path, subfolder=subfolder, **hub)
        spec = json.loads((folder / SPEC_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS_FILE))
        base = str(folder / ENCODER_DIR) if spec["base_model"] == ENCODER_DIR else spec["base_model"]
        encoder = AutoModel.from_pretrained(base)
        overrides = {k.removeprefix("base."): v for k, v in tensors.items() if k.startswith("base.")}
        if overrides:
            missing = sorted(set(overrides) - set(encoder.state_dict()))
            if missing:
                raise ValueError(f"{WEIGHTS_FILE}: tensors {missing} are not in the base encoder {base}")
            encoder.load_state_dict(overrides, strict=False)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return cls(encoder, tokenizer, tensors["prefix"], spec, **config)
