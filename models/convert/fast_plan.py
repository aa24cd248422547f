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


# The third plan re-encodes nothing: SmolLM2's Q4_1 file has no wider matrix for the 8-bit plan and no
# headroom for the 4-bit one, and its q4-a8 is 1.24x llama.cpp's KL. It gives the inputs where int8 rounding
# costs most fp32 activations, and keeps int8 ones for ffn_gate/ffn_up (half of each layer's weights) and
# the head. SmolLM2, the pull's 512-token text, llama.cpp's KL 0.00250 (p99 0.0118) as the floor:
# | fp32 inputs on | KL mean | KL p99 |
# |---|---|---|
# | nothing (q4-a8) | 0.00310 | 0.0187 |
# | ffn_down | within | 0.0143 |
# | ffn_down, attn_output | within | 0.0122 |
# | ffn_down, attn_output, attn_v | 0.00162 | 0.0071 |
# | ffn_down, attn_output, attn_q/k/v (this plan) | 0.00132 | 0.0059 |
# | ffn_down, ffn_gate, ffn_up | 0.00165 | 0.0091 |
# This plan keeps half the floor's margin on the p99 (another CPU's int8 kernels round differently) and one
# node for the fused q/k/v. The same in the first half of the layers only gave 0.00206 (p99 0.0115) and was
# 1 % faster over six interleaved rounds (SmolLM2): not worth that margin. 8-bit matrices keep int8 inputs
# (fp32 ones there run 32-48x slower: linear.py).
PLANS = (
    Plan("4-bit", Encoding(4, 32, zero_point=True), Encoding(8, 32, False), Encoding(8, 32, False)),
    Plan("8-bit", None, Encoding(8, 32, False), Encoding(8, 32, False)),
    Plan(
        "fp32 inputs but ffn_gate/ffn_up",
        None,
        None,
        None,
        fp32_inputs=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down"),
    ),
)
