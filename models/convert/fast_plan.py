"""Which encoding each matrix of the `fast` variant gets: a plan per kind of tensor, chosen by what
llama.cpp's quantizer decided a tensor needs (a "_M" mix gives its sensitive tensors, the head, attn_v and
half of ffn_down, more than 4 bits), and plans tried in order at pull time, cheapest first: the first whose
measured KL is within the quality floor (convert/nominal.py) is installed as `fast`.

Why these (the KL measurements in docs/performance.md): MatMulNBits
with int8 activations quantizes the activations per weight block, so a wider block reads fewer bytes (fp32
scale and block sum per block) but rounds the activations more coarsely, and that, not the weights'
rounding, is what an 8-bit re-encoding costs in KL. A 4-bit re-encoding of a 4-bit GGUF tensor is a second
quantization of the weights as large as the first: only models with headroom over llama.cpp keep it within
the floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.convert.requant import Encoding

FOUR_BIT_SOURCES = ("Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K")


@dataclass(frozen=True)
class Plan:
    """One candidate `fast` variant: an encoding for the matrices the GGUF holds in 4 bits or fewer, one for
    the wider ones (5, 6 and 8 bits, float) and one for the LM head; None keeps a tensor's exact mapping (as
    in q4-a8), whose initializers the variants then share. `fp32_inputs`: the kinds of matrix (`ffn_down`)
    whose exact 4-bit MatMulNBits take fp32 activations instead of int8 ones, where the int8 rounding of
    their input is what puts q4-a8 above the floor."""

    name: str
    four_bit: Encoding | None
    wider: Encoding | None
    head: Encoding | None
    fp32_inputs: tuple[str, ...] = ()

    def fp32_input(self, tensor: str) -> bool:
        """Whether the matrix named `tensor` (`blk.3.ffn_down.weight`) takes fp32 activations."""
        parts = tensor.split(".")
        return len(parts) >= 2 and parts[-2] in self.fp32_inputs

    def choose(self, type_name: str, k: int, *, head: bool = False) -> Encoding | None:
        """The encoding of one matrix at the plan's block, or the widest smaller one dividing k."""
        enc = self.head if head else self.four_bit if type_name in FOUR_BIT_SOURCES else self.wider
        if enc is None:
            return None
        block = enc.block
        while k % block and block > 16:
            block //= 2
        return Encoding(enc.bits, block, enc.zero_point)


# The last two plans re-encode nothing: SmolLM2's Q4_1 file has no wider matrix for the 8-bit plan and no
# headroom for the 4-bit one, and its q4-a8 is 1.24x llama.cpp's KL. They give fp32 activations to the inputs
# where int8 rounding costs most, and keep int8 ones everywhere else. SmolLM2, the pull's 512-token text,
# llama.cpp's KL 0.00250 (p99 0.0118) as the floor, measured on an AVX-512 VNNI CPU:
# | fp32 inputs on | share of the weights | KL mean | KL p99 |
# |---|---|---|---|
# | nothing (q4-a8) | 0 | 0.00310 | 0.0187 |
# | attn_k | 3 % | 0.00294 | 0.0143 |
# | attn_v | 3 % | 0.00251 | 0.0127 |
# | attn_k, attn_v (the third plan) | 6 % | 0.00194 | 0.0088 |
# | attn_v, attn_output | 12 % | 0.00250 | 0.0175 |
# | attn_q/k/v, attn_output, ffn_down in the first half of the layers | 25 % | 0.00206 | 0.0115 |
# | ffn_down | 25 % | within | 0.0143 |
# | attn_q/k/v, attn_output, ffn_down (the fourth plan) | 50 % | 0.00132 | 0.0059 |
# The key and value projections feed every later position's attention through the cache, so their rounding
# counts more than their size: the third plan gets under the floor with an eighth of the fourth's fp32-input
# weights. What fp32 inputs cost depends on the CPU (counted per decoded token under an emulated AVX2 CPU,
# SmolLM2: q4-a8 0.60x llama.cpp's instructions, the fourth plan 1.21x: docs/cpu-classes.md), so the plans
# go cheapest first on every class: each is a subset of the next one's fp32 inputs. The fourth stays for a
# model whose keys and values are not enough. 8-bit matrices keep int8 inputs (fp32 ones there run 32-48x
# slower: linear.py).
PLANS = (
    Plan("4-bit", Encoding(4, 32, zero_point=True), Encoding(8, 32, False), Encoding(8, 32, False)),
    Plan("8-bit", None, Encoding(8, 32, False), Encoding(8, 32, False)),
    Plan("fp32 inputs on attn_k/attn_v", None, None, None, fp32_inputs=("attn_k", "attn_v")),
    Plan(
        "fp32 inputs but ffn_gate/ffn_up",
        None,
        None,
        None,
        fp32_inputs=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down"),
    ),
)
