"""What one training step does: context, block size, objective, batch, precision, memory policy.

The objective is a seam: BD3-LM is the reference mask (noisy block -> its own block and earlier
clean blocks; clean block -> clean blocks up to itself). Other objectives change how many views
and passes a step runs, which tokens carry the loss and what is frozen (`objectives.py`); the
fields below that only one objective reads are ignored by the others.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

# "ar": plain autoregressive training, a causal L-token sequence with a next-token loss (no 2L):
# the objective TorchTitan and Megatron-Core train (shared/reference/frameworks.md)
Objective = Literal["bd3lm", "fast-dllm-v2", "diffusiongemma", "dflash2", "ar"]
Checkpointing = Literal["full", "none"]
DType = Literal["bf16", "fp16", "fp32"]
# the dtype of the transformer blocks' linear GEMMs: "fp8" as torchao Float8 / Transformer Engine run
# them (frameworks.md A2, B3); attention stays in `dtype` unless the implementation profile says otherwise
LinearDType = Literal["bf16", "fp8"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# dflash2: where the target features come from (implementation.md section 14): "offline" reads them
# from storage through pinned host memory to the GPU one batch ahead (a real training job: the
# planning default); "synthetic" holds them on the GPU once, no I/O (the published benchmark runs)
Features = Literal["offline", "synthetic"]


def parse_tokens(text: str | int) -> int:
    """'256k' -> 262144, '1m' -> 1048576, '4096' -> 4096 (powers of two, as context lengths are)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower()
    scale = 1
    if s.endswith("k"):
        scale, s = 1024, s[:-1]
    elif s.endswith("m"):
        scale, s = 1024 * 1024, s[:-1]
    try:
        value = int(s) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (use e.g. 4096, 256k, 1m)") from None
    return value


class Workload(BaseModel):
    """One step of block-diffusion training of one model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: PositiveInt  # context L (clean tokens); the model sees 2L for BD3-LM, L for AR
    block_size: PositiveInt = 256  # AR: always 1 (`_causal_block`)
    objective: Objective = "bd3lm"
    micro_batch: PositiveInt = 1  # sequences per replica per step
    dtype: DType = "bf16"
    checkpointing: Checkpointing = "full"
    zero_stage: int = Field(2, ge=0, le=3)
    # diffusiongemma: probability of the self-conditioning pass (a second, gradient-free canvas pass)
    self_conditioning: float = Field(0.5, ge=0, le=1)
    # dflash2: anchor positions sampled per sequence (each starts one draft block of block_size)
    max_anchors: PositiveInt = 2048
    # dflash2: the loss runs over the vocabulary in blocks of this many entries (None: whole vocabulary)
    vocab_block: PositiveInt | None = 32768
    # dflash2: target features read offline (the default for planning a real job) or synthetic
    features: Features = "offline"
    # dflash2: the drafter's attention window when every layer is windowed, filled from the model
    # by `objectives.as_executed` (the context is then trimmed to the anchors' windows, section 14)
    drafter_window: PositiveInt | None = None
    # linear GEMMs' dtype; None: the implementation profile's choice (bf16 when it names none)
    linear_dtype: LinearDType | None = None

    @model_validator(mode="before")
    @classmethod
    def _causal_block(cls, data):
        """AR has no blocks: its causal mask is BD3-LM's clean-to-clean mask at block 1 (a clean
        token sees the clean tokens up to itself), so the block is 1 whatever was passed (the
        commands' generic 256 included; `csbp` refuses an explicit --block-size with ar)."""
        if isinstance(data, dict) and data.get("objective") == "ar":
            return {**data, "block_size": 1}
        return data

    @model_validator(mode="after")
    def _check(self) -> "Workload":
        if self.seq_len % self.block_size:
            raise ValueError(
                f"seq-len {self.seq_len} is not a multiple of block-size {self.block_size}"
            )
        return self

    @property
    def n_blocks(self) -> int:
        return self.seq_len // self.block_size

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
