"""`csbp validate`: run a suite of plans for real on this host and compare with the simulator."""

from __future__ import annotations

from simulator.spec import AttentionSpec, ModelSpec

VALIDATION_MODEL = ModelSpec(
    name="validate-small", hidden=128, ffn=384, vocab=512,
    layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=32),) * 4,
    source="csbp validate: a small dense GQA model, large enough that arithmetic rather than "
           "per-op overhead dominates a CPU step")
