"""What one rank does for a plan: its sequences, its positions of the 2L sequence (objective ar:
of the causal L-token sequence, held at [L, 2L) by `CausalLayout`), its attention, and its part of
the model.

A plan is axes composed, each in its own module. The mesh (`runtime.mesh`) places ranks and makes
the process groups. The DP axis (`dp.py`) gives each replica its own sequences and sums gradients.
The context axis (`context.py`) gives a rank its positions and K/V exchange, read from the
simulator's layout: CP, pure BP and CSBP run the same code with different layouts, because the
layout (ownership, exchanged rows) is all that differs between them and the runtime never computes
ownership of its own. Tensor parallelism (`runtime.tensor_parallel`) splits a context rank's
positions, heads, FFN width and vocabulary over tp ranks; expert parallelism
(`runtime.expert_parallel`) splits the experts over ep ranks, each with sequences of its own (a
step trains dp x ep x micro-batch sequences, as the simulator counts them). `reference.py` is the
single-process run that every plan must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from csbp.runtime.distributed import expert_parallel, tensor_parallel
from csbp.runtime.models.attention import Attention
from csbp.runtime.distributed.comm import Comm
from csbp.runtime.models.model import BlockDiffusionLM
from csbp.runtime.models.objective import (bd3lm_targets, make_batch, make_causal_batch,
                                           next_token_targets, weighted_cross_entropy)
from csbp.runtime.distributed.mesh import Mesh, build as build_mesh
from csbp.runtime.distributed.plans import context, dp
from csbp.simulator.plan import rules as plan_rules
from csbp.simulator.errors import InputError
from csbp.simulator.layout.layout import Layout
from csbp.simulator.workload.objectives import objective_shape
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload


@dataclass
class Work:
    """One rank's share of a step."""

    workload: Workload
    layout: Layout
    ctx_rank: int
    sequences: range  # global ids of the sequences this rank's replica trains on
    total_tokens: int  # loss rows of the whole step (noisy tokens; ar: every token): the normaliser
    attention: Attention
    mesh: Mesh = field(default_factory=lambda: Mesh({}))
    comm: Comm | None = None

    @property
    def positions(self) -> torch.Tensor:
        """The context rank's positions, in tensor-parallel shard order."""
        return self.attention.positions

    def loss(self, model: BlockDiffusionLM, step: int, seed: int) -> torch.Tensor:
        """This rank's part of the step's loss (the parts of one TP rank's peers sum to the
        whole; TP ranks of one context rank hold the same part)."""
        w = self.workload
        device = model.embed.weight.device
        positions = self.positions.to(device)
        if objective_shape(w, model.spec).causal:  # ar: every position is a loss row
            tokens = make_causal_batch(self.sequences, step, seed, w.seq_len, model.spec.vocab)
            inputs, targets, weights = next_token_targets(tokens.to(device), positions, w.seq_len)
            hidden = model(inputs, positions, w.seq_len, self.attention)
            return weighted_cross_entropy(model.lm_head, hidden, targets, weights) / self.total_tokens
        batch = make_batch(self.sequences, step, seed, w.seq_len, w.block_size, model.spec.vocab)
        batch = batch.to(device)
        hidden = model(batch.tokens[:, positions], positions, w.seq_len, self.attention)
        noisy = positions[positions < w.seq_len]  # sorted: shard order keeps them in order
        targets, weights = bd3lm_targets(batch, noisy, w.seq_len, w.block_size, model.mask_id)
        rows = hidden[:, :len(noisy) // self.mesh.tp.size]  # noisy rows lead every shard
        return weighted_cross_entropy(model.lm_head, rows, targets, weights) / self.total_tokens


def check_supported(spec: ModelSpec, workload: Workload, plan: Plan) -> None:
    """What the runtime cannot run of a plan, as one-line input errors: the shape rules every
    plan is held to (`simulator/plan/rules.py`, read with this runtime's implementation profile,
    so the runtime refuses exactly what the planner and `csbp simulate` refuse), and what it
    does not implement yet."""
    from csbp.runtime.training.train import RUNTIME_IMPLEMENTATION

    if workload.zero_stage == 3:
        raise InputError("ZeRO-3 (weights sharded and gathered per layer) is not supported by "
                         "the runtime yet: use --zero 2 (sharded gradients and optimizer state)")
    plan_rules.check(spec, workload, plan, RUNTIME_IMPLEMENTATION)


def rank_work(spec: ModelSpec, workload: Workload, plan: Plan, rank: int, comm: Comm) -> Work:
    """Rank `rank`'s work; collective: every rank must call it (it creates process groups)."""
    check_supported(spec, workload, plan)
    layout = Layout.build(workload, plan)
    m = build_mesh(plan, layout, rank, comm)
    attention = context.attention(spec, layout, plan, m, comm)
    replica = m.where["dp"] * plan.ep + m.where["ep"]
    return Work(workload, layout, m.where["ctx"], dp.sequences(replica, workload.micro_batch),
                plan.sequences * workload.micro_batch * workload.seq_len, attention, m, comm)


def parallelize(model: BlockDiffusionLM, work: Work) -> dict[str, tuple[int, int, int]]:
    """Cut the (whole) model to this rank's part, in place: experts over EP, then TP; freeze the
    router when the objective does. Returns what TP cut: (dim, start, stop) per weight."""
    if objective_shape(work.workload, model.spec).frozen_router:
        for block in model.blocks:
            if hasattr(block.ffn, "router"):
                block.ffn.router.weight.requires_grad_(False)
    m = work.mesh
    if m.ep.size > 1:
        expert_parallel.parallelize(model, expert_parallel.ExpertGroup(work.comm, m.ep))
    if m.tp.size > 1:
        return tensor_parallel.parallelize(model, tensor_parallel.TensorParallel(work.comm, m.tp))
    return {}
