"""Test-only fault injection, so failure handling can be tested on purpose rather than by luck.

    CSBP_FAULT="rank=1,step=2,kind=raise"    # raise | kill | nan | hang

The fault strikes between the forward and the backward pass of that step on that rank, while
its peers are inside collectives: `raise` an exception, `kill` the process (SIGKILL), make the
loss `nan`, or `hang` (sleep until the collective timeout ends the run). Read here only.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Literal, get_args

import torch

ENV = "CSBP_FAULT"
Kind = Literal["raise", "kill", "nan", "hang"]


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: Kind

    def strike(self, rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, unless this fault is due now on this rank."""
        if (rank, step) != (self.rank, self.step):
            return loss
        if self.kind == "raise":
            raise RuntimeError(f"injected fault ({ENV})")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while self.kind == "hang":
            time.sleep(60)
        return loss * float("nan")


def from_env() -> Fault | None:
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        fault = Fault(int(fields["rank"]), int(fields["step"]), fields["kind"])
    except (ValueError, KeyError):
        fault = None
    if fault is None or fault.kind not in get_args(Kind):
        raise ValueError(f"{ENV}={text!r}: use rank=R,step=S,kind={'|'.join(get_args(Kind))}")
    return fault
