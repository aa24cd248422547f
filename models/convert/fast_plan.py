"""Which encoding each matrix of the `fast` variant gets: a plan per kind of tensor, chosen by what
llama.cpp's quantizer decided a tensor needs (a "_M" mix gives its sensitive tensors, the head, attn_v and
half of ffn_down, more than 4 bits), and plans tried in order at pull time, cheapest first: the first whose
measured KL is within the quality floor (convert/floor.py) is installed as `fast`.

Why these (bench/experiments/fast_encodings.py and the KL measurements in docs/performance.md): MatMulNBits
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
    in q4-a8), whose initializers the variants then share."""

    name: str
    four_bit: Encoding | None
    wider: Encoding | None
    head: Encoding | None

    def choose(self, type_name: str, k: int, *, head: bool = False) -> Encoding | None:
        """The encoding of one matrix at the plan's block, or the widest smaller one dividing k."""
        enc = self.head if head else self.four_bit if type_name in FOUR_BIT_SOURCES else self.wider
        if enc is None:
            return None
        block = enc.block
        while k % block and block > 16:
            block //= 2
        return Encoding(enc.bits, block, enc.zero_point)


PLANS = (
    Plan("4-bit", Encoding(4, 32, zero_point=True), Encoding(8, 32, False), Encoding(8, 32, False)),
    Plan("8-bit", None, Encoding(8, 32, False), Encoding(8, 32, False)),
)
