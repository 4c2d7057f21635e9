"""csbp: plan, simulate and run long-context block-diffusion training (DP / CP / BP / CSBP).

The library face of the `csbp` command, for notebooks and scripts:

    import csbp
    found = csbp.plan(model="nemotron-diffusion-8b", seq_len="256k", nodes=2)
    found.recommended.label, found.to_json()      # to_json() is `csbp plan --json`
    r = csbp.simulate(plan="dp=2,cp=8,bp=8")
    r.tokens_per_s, r.to_json()                   # to_json() is `csbp simulate --json`

Keyword arguments are the command's flags (`seq_len` is `--seq-len`), checked the same way: bad
input raises `csbp.InputError` with the one line the command would print.
"""

from __future__ import annotations

from csbp.api import plan, simulate
from csbp.simulator.errors import InputError

__all__ = ["plan", "simulate", "InputError"]
