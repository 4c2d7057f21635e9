"""What one rank does for a plan: its sequences, its positions of the 2L sequence, its attention.

A plan is two axes composed. The DP axis (`dp.py`) places ranks, gives each replica its own
sequences and sums gradients over every rank. The context axis (`context.py`) gives a rank its
positions and K/V exchange, read from the simulator's layout: CP, pure BP and CSBP run the same
code with different layouts, because the layout (ownership, exchanged rows) is all that differs
between them and the runtime never computes ownership of its own. `reference.py` is the
single-process run that every plan must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from csbp.runtime.attention import Attention
from csbp.runtime.comm import Comm
from csbp.runtime.model import BlockDiffusionLM
from csbp.runtime.objective import bd3lm_loss, make_batch
from csbp.runtime.plans import context, dp
from csbp.simulator.layout import Layout
from csbp.simulator.plan import Plan
from csbp.simulator.spec import ModelSpec
from csbp.simulator.workload import Workload


@dataclass
class Work:
    """One rank's share of a step."""

    workload: Workload
    layout: Layout
    ctx_rank: int
    sequences: range  # global ids of the sequences this rank's replica trains on
    total_tokens: int  # noisy tokens of the whole step: the loss normaliser
    attention: Attention

    @property
    def positions(self) -> torch.Tensor:
        return self.attention.positions

    def loss(self, model: BlockDiffusionLM, step: int, seed: int) -> torch.Tensor:
        """This rank's part of the step's loss (the parts of all ranks sum to the whole)."""
        w = self.workload
        device = model.embed.weight.device
        batch = make_batch(self.sequences, step, seed, w.seq_len, w.block_size, model.spec.vocab)
        batch = batch.to(device)
        positions = self.positions.to(device)
        hidden = model(batch.tokens[:, positions], positions, w.seq_len, self.attention)
        return bd3lm_loss(model.lm_head, hidden, batch, positions, w.seq_len, w.block_size,
                          model.mask_id, self.total_tokens)


def rank_work(spec: ModelSpec, workload: Workload, plan: Plan, rank: int, comm: Comm) -> Work:
    """Rank `rank`'s work; collective: every rank must call it (it creates process groups)."""
    dp.check_supported(plan)
    where = dp.coordinates(plan, rank)
    layout = Layout.build(workload, plan)
    attention = context.attention(spec, layout, plan, where, comm)
    return Work(workload, layout, where["ctx"], dp.sequences(where["dp"], workload.micro_batch),
                plan.dp * workload.micro_batch * workload.seq_len, attention)
