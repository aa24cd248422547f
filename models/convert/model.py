"""A GGUF read as a model of one architecture family: the file (models/gguf/reader.py) plus its family, the
family's hyper-parameters, and the check that the file holds exactly the tensors that family uses.

Everything that can be wrong with an input file is an InvalidModelFile / UnsupportedModel (or one of its
kinds) by the end of the constructor, so the graph builder and the reference can assume a well-formed model.
"""

from __future__ import annotations

from pathlib import Path

from models.convert.families import Family, ModelConfig, family_for
from models.convert.heap import trim_heap
from models.errors import InvalidModelFile, UnsupportedModel
from models.gguf.reader import GGUFFile, Tensor

VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


class GGUFModel:
    """An opened, validated GGUF of a supported architecture family."""

    def __init__(self, path: Path) -> None:
        self.file = GGUFFile(Path(path))
        self.path = self.file.path
        self.reader = self.file.reader
        self.metadata = self.file.metadata
        self.family: Family = family_for(self.metadata.get("general.architecture"), self.path.name)
        self.shapes = {n: s for n in self.file.names() if (s := self.file.shape(n)) is not None}
        self.config: ModelConfig = self.family.read_config(self.metadata, self.shapes, self.path.name)
        self._check_tensors()

    def _check_tensors(self) -> None:
        """Every tensor the family needs, with its shape and a type we map; none it would silently ignore (a
        bias or norm we do not apply would give fluent nonsense)."""
        expected = self.family.tensor_shapes(self.config)
        unused = sorted(set(self.shapes) - set(expected))
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise UnsupportedModel(
                f"{self.path.name}: tensors {', '.join(unused[:3])}{more} are not part of the "
                f"{self.family.name} family as supported here"
            )
        for name, shape in expected.items():
            got = self.shapes.get(name)
            if got is None:
                raise InvalidModelFile(f"{self.path.name}: missing tensor {name}")
            self.file.type_name(name)  # UnsupportedQuantization, naming the tensor
            if got != shape:
                raise InvalidModelFile(f"{self.path.name}: tensor {name} has shape {got}, expected {shape}")

    @property
    def tensors(self) -> list[str]:
        return list(self.shapes)

    def tensor(self, name: str) -> Tensor:
        return self.file.tensor(name)

    def tensor_types(self) -> dict[str, int]:
        return self.file.tensor_types()

    def drop_vocabulary(self) -> None:
        """Forget the tokenizer's arrays once the tokenizer is written: the reader keeps every token and
        merge as a numpy view of its own (about 120 MB for Qwen's 151,936 tokens and 151,387 merges)."""
        for key in VOCABULARY_KEYS:
            self.reader.fields.pop(key, None)

    def release(self) -> None:
        """Give back what the last step read and freed: the file's pages and the heap's free memory.
        Called between layers, so a conversion's RSS is a layer's worth, not the model's."""
        self.file.release()
        trim_heap()
