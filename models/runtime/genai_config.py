"""An onnxruntime-genai model folder's description (genai_config.json) and its tokenizer files.

The folder holds the decoder (`model.decoder.filename`, its external data next to it), `tokenizer.json` and
usually `tokenizer_config.json`. The decoder's I/O names, KV layout and stop ids come from genai_config.json;
the parts of it we use are kept in our manifest (DecoderIO.to_dict), so loading never re-reads the config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tokenizers

from models.errors import InvalidModelFile
from models.runtime.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, Tokenizer

GENAI_CONFIG = "genai_config.json"


@dataclass(frozen=True)
class DecoderIO:
    """How to call a decoder in onnxruntime-genai's layout."""

    filename: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int | None
    vocab: int
    context_length: int
    model_type: str
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    # past and present are one preallocated buffer per layer (GroupQueryAttention's shared mode), or
    # present = past + the new tokens, fed back as the next past
    share_buffer: bool
    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    position_ids: str | None = None
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"

    @classmethod
    def from_genai_config(cls, cfg: dict[str, Any]) -> DecoderIO:
        try:
            model = cfg["model"]
            dec = model["decoder"]
            inputs, outputs = dec.get("inputs", {}), dec.get("outputs", {})
            eos = model.get("eos_token_id")
            bos = model.get("bos_token_id")
            context = model.get("context_length") or cfg.get("search", {}).get("max_length")
            return cls(
                filename=str(dec["filename"]),
                n_layers=int(dec["num_hidden_layers"]),
                n_heads=int(dec["num_attention_heads"]),
                n_kv_heads=int(dec.get("num_key_value_heads") or dec["num_attention_heads"]),
                head_dim=int(dec["head_size"]),
                hidden=int(dec["hidden_size"]) if dec.get("hidden_size") else None,
                vocab=int(model["vocab_size"]),
                context_length=int(context),
                model_type=str(model.get("type", "")),
                bos_id=int(bos[0] if isinstance(bos, list) else bos) if bos is not None else None,
                eos_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None),
                pad_id=int(model["pad_token_id"]) if model.get("pad_token_id") is not None else None,
                share_buffer=bool(cfg.get("search", {}).get("past_present_share_buffer", False)),
                input_ids=inputs.get("input_ids", "input_ids"),
                attention_mask=inputs.get("attention_mask", "attention_mask"),
                position_ids=inputs.get("position_ids"),
                past_key=inputs.get("past_key_names", "past_key_values.%d.key"),
                past_value=inputs.get("past_value_names", "past_key_values.%d.value"),
                logits=outputs.get("logits", "logits"),
                present_key=outputs.get("present_key_names", "present.%d.key"),
                present_value=outputs.get("present_value_names", "present.%d.value"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidModelFile(f"{GENAI_CONFIG} is missing or has a bad value for {err}") from err

    @classmethod
    def from_folder(cls, folder: Path) -> DecoderIO:
        path = Path(folder) / GENAI_CONFIG
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InvalidModelFile(
                f"{folder} has no {GENAI_CONFIG}: not an onnxruntime-genai folder"
            ) from None
        except (OSError, ValueError) as err:
            raise InvalidModelFile(f"cannot read {path}: {err}") from err
        if not isinstance(cfg, dict):
            raise InvalidModelFile(f"{path} is not a JSON object")
        return cls.from_genai_config(cfg)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderIO:
        return cls(**{**data, "eos_ids": tuple(data.get("eos_ids") or ())})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"eos_ids": list(self.eos_ids)}

    def architecture(self) -> dict[str, Any]:
        """The manifest's architecture entry (the names the engine and the memory estimate read)."""
        return {
            "name": self.model_type or "onnxruntime-genai",
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden": self.hidden,
            "vocab": self.vocab,
            "context_length": self.context_length,
        }


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json gives special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template:
        return template
    jinja = folder / "chat_template.jinja"  # newer Hugging Face folders keep it apart
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def load_tokenizer(folder: Path, io: DecoderIO) -> Tokenizer:
    """The tokenizer of a foreign folder: tokenizer.json, plus tokenizer_config.json when present; stop and
    start ids from genai_config.json (which is what onnxruntime-genai itself stops on)."""
    folder = Path(folder)
    try:
        hf = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_JSON))
    except Exception as err:  # tokenizers raises a plain Exception
        raise InvalidModelFile(f"cannot load {folder / TOKENIZER_JSON}: {err}") from err
    try:
        config = json.loads((folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as err:
        raise InvalidModelFile(f"cannot read {folder / TOKENIZER_CONFIG}: {err}") from err

    def tid(key: str) -> int | None:
        text = _token_text(config.get(key))
        return None if text is None else hf.token_to_id(text)

    eos_id = io.eos_ids[0] if io.eos_ids else tid("eos_token")
    return Tokenizer(
        hf,
        bos_id=io.bos_id if io.bos_id is not None else tid("bos_token"),
        eos_id=eos_id,
        eos_ids=io.eos_ids,
        unk_id=tid("unk_token"),
        pad_id=io.pad_id if io.pad_id is not None else tid("pad_token"),
        add_bos=bool(config.get("add_bos_token", False)),
        chat_template=_chat_template(folder, config),
    )
