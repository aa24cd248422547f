"""Foreign-style onnxruntime-genai folders made from our converted tiny model.

Our converter's decoder is a genai decoder with a shared KV buffer and last-position logits. The variants
here re-export it the ways other exporters do: separate past/present buffers (the config says so; the
same GroupQueryAttention then appends to a copy), logits for every position (no num_logits_to_keep input),
a `position_ids` input, and fp16 KV and logits (Casts at the graph's edges). Each folder has no manifest
of ours: `simmer pull ./folder` must take it as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def foreign_copy(
    model_dir: Path, dest: Path, *, share_buffer: bool = True, decoder: str | None = None
) -> Path:
    """The converted folder without our manifest, its genai_config.json saying how the KV buffers work
    (and, when given, naming another of our variants' .onnx files as the decoder)."""
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("manifest.json"))
    cfg = json.loads((dest / "genai_config.json").read_text())
    cfg["search"]["past_present_share_buffer"] = share_buffer
    if decoder is not None:
        cfg["model"]["decoder"]["filename"] = decoder
    (dest / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def decoder_path(folder: Path) -> Path:
    cfg = json.loads((folder / "genai_config.json").read_text())
    return folder / cfg["model"]["decoder"]["filename"]


def _edit(folder: Path, change) -> None:
    path = decoder_path(folder)
    model = onnx.load(str(path), load_external_data=False)  # the weights stay in weights.data
    change(model)
    onnx.save(model, str(path))


def all_position_logits(folder: Path) -> None:
    """Logits [batch, seq, vocab] always, as exporters without our num_logits_to_keep input give them: the
    input goes, and its initializer (0: every position) becomes a constant."""

    def change(model: onnx.ModelProto) -> None:
        g = model.graph
        keep = [i for i in g.input if i.name == "num_logits_to_keep"]
        assert len(keep) == 1, "the converter's num_logits_to_keep input was not found"
        g.input.remove(keep[0])

    _edit(folder, change)


def position_ids_input(folder: Path) -> None:
    """A `position_ids` input [batch, seq]; logits move by 1000 per position it is off, so a caller that
    feeds wrong positions gets wrong logits."""

    def change(model: onnx.ModelProto) -> None:
        g = model.graph
        g.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]))
        (reshape,) = [n for n in g.node if "logits" in n.output]
        reshape.output[0] = "logits_raw"
        g.initializer.extend(
            [
                numpy_helper.from_array(np.array(1, np.int64), "pos_one"),
                numpy_helper.from_array(np.array(1000.0, np.float32), "pos_penalty"),
            ]
        )
        g.node.extend(
            [
                helper.make_node("Shape", ["attention_mask"], ["pos_mask_shape"], start=1, end=2),
                helper.make_node("Sub", ["pos_mask_shape", "pos_one"], ["pos_expected_last"]),
                helper.make_node("ReduceMax", ["position_ids"], ["pos_last"], keepdims=0),
                helper.make_node("Sub", ["pos_last", "pos_expected_last"], ["pos_off"]),
                helper.make_node("Abs", ["pos_off"], ["pos_abs"]),
                helper.make_node("ReduceSum", ["pos_abs"], ["pos_abs_sum"], keepdims=0),
                helper.make_node("Cast", ["pos_abs_sum"], ["pos_abs_f"], to=TensorProto.FLOAT),
                helper.make_node("Mul", ["pos_abs_f", "pos_penalty"], ["pos_shift"]),
                helper.make_node("Add", ["logits_raw", "pos_shift"], ["logits"]),
            ]
        )

    _edit(folder, change)
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"]["inputs"]["position_ids"] = "position_ids"
    (folder / "genai_config.json").write_text(json.dumps(cfg, indent=2))


def fp16_edges(folder: Path) -> None:
    """KV inputs and outputs and the logits in fp16, converted at the graph's edges."""

    def change(model: onnx.ModelProto) -> None:
        g = model.graph
        casts = []
        for inp in g.input:
            if inp.name.startswith("past_key_values."):
                inp.type.tensor_type.elem_type = TensorProto.FLOAT16
                inner = inp.name + "_f32"
                for node in g.node:
                    for i, name in enumerate(node.input):
                        if name == inp.name:
                            node.input[i] = inner
                casts.append(helper.make_node("Cast", [inp.name], [inner], to=TensorProto.FLOAT))
        for out in g.output:
            if out.name.startswith("present.") or out.name == "logits":
                out.type.tensor_type.elem_type = TensorProto.FLOAT16
                inner = out.name + "_f32"
                for node in g.node:
                    for i, name in enumerate(node.output):
                        if name == out.name:
                            node.output[i] = inner
                casts.append(helper.make_node("Cast", [inner], [out.name], to=TensorProto.FLOAT16))
        nodes = list(casts[: sum(1 for c in casts if c.output[0].endswith("_f32"))]) + list(g.node)
        nodes += [c for c in casts if not c.output[0].endswith("_f32")]
        del g.node[:]
        g.node.extend(nodes)

    _edit(folder, change)
