"""One error vocabulary for everything below the web layer.

Each error carries a stable machine `code`; the server maps codes to HTTP statuses and
OpenAI-shaped bodies at the edge (server/http/errors.py), the CLI prints `str(err)`.
"""

from __future__ import annotations


class SimmerError(Exception):
    """Base class. `code` is stable and machine-readable; the message is for people."""

    code = "simmer_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelNotFound(SimmerError):
    code = "model_not_found"


class ModelNotInstalled(SimmerError):
    code = "model_not_installed"


class InvalidModelFile(SimmerError):
    """Truncated, not a GGUF, corrupt."""

    code = "invalid_model_file"


class UnsupportedModel(SimmerError):
    """Architecture or tensor type we cannot convert."""

    code = "unsupported_model"


class ModelNotChat(SimmerError):
    """The model has no chat template (a base model): it serves text completions only."""

    code = "model_not_chat"

    @classmethod
    def for_model(cls, model_id: str) -> ModelNotChat:
        return cls(
            f"The model '{model_id}' has no chat template (it is a base model): use /v1/completions, or "
            "start the server with SIMMER_CHAT_TEMPLATE naming a Jinja chat template file for it",
            param="model",
        )


class WrongModelKind(SimmerError):
    """An embedding model asked to generate, or a generative model asked for embeddings."""

    code = "wrong_model_kind"

    @classmethod
    def for_model(cls, model_id: str, kind: str) -> WrongModelKind:
        if kind == "embedding":
            what = "an embedding model: it answers embeddings requests only (/v1/embeddings, /api/embed)"
        else:
            what = f"a {kind} model: it has no embeddings; name an embedding model (e.g. all-minilm-l6-v2)"
        return cls(f"The model '{model_id}' is {what}", param="model")


class UnsupportedArchitecture(UnsupportedModel):
    """A GGUF whose `general.architecture` has no family in models/convert/families."""

    code = "unsupported_architecture"


class HashMismatch(SimmerError):
    code = "hash_mismatch"


class InsufficientDisk(SimmerError):
    """Not enough free disk space to download or convert a model (before starting, or ENOSPC/EDQUOT on
    the way). Carries the numbers: bytes needed, bytes free, and the folder (or file) concerned."""

    code = "insufficient_disk"

    def __init__(self, message: str, *, needed_bytes: int | None, free_bytes: int | None, where: str) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.where = where


class InsufficientMemory(SimmerError):
    """Loading would exceed the memory budget. Carries the numbers when the planner refused: bytes the model
    needs, bytes free, bytes unloading every idle model would free."""

    code = "insufficient_memory"

    def __init__(
        self,
        message: str,
        *,
        needed_bytes: int | None = None,
        free_bytes: int | None = None,
        idle_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.idle_bytes = idle_bytes

    @property
    def numbers(self) -> dict[str, int] | None:
        numbers = {
            "needed_bytes": self.needed_bytes,
            "free_bytes": self.free_bytes,
            "idle_bytes": self.idle_bytes,
        }
        known = {k: v for k, v in numbers.items() if v is not None}
        return known or None


class SourceUnavailable(SimmerError):
    """Network, hub or registry unreachable (for example offline)."""

    code = "source_unavailable"


class VerificationFailed(SimmerError):
    code = "verification_failed"


class ContextLengthExceeded(SimmerError):
    """The prompt does not fit the context. The numbers, when known, let each API word the refusal its own
    way (server/http/errors.py)."""

    code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        context_length: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self.context_length = context_length
        self.prompt_tokens = prompt_tokens


class InvalidParameter(SimmerError):
    code = "invalid_parameter"


class Cancelled(SimmerError):
    code = "cancelled"


class DeviceOverheated(SimmerError):
    """The (simulated) device killed the app at T_critical."""

    code = "device_overheated"


class UnsupportedQuantization(UnsupportedModel):
    """A tensor type the converter has no exact mapping for (IQ*, TQ*, MXFP4, ...)."""

    code = "unsupported_quantization"
