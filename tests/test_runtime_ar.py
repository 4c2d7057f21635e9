"""Objective ar in the runtime (issue 24): plain autoregressive training under DP and CP (and TP).

Every plan reproduces the single-process loss and every gradient, and each rank's counted bytes
equal the step graph's prediction for the plan (csbp-runtime's profile) and a hand count of the
head-tail CP exchange. The single-process reference, which runs the layout's causal mask at block
1 on positions [L, 2L), is itself held to an independent causal next-token model: torch's SDPA
with is_causal on tokens 0..L-1 and the cross-entropy against the tokens shifted by one.
All cases of one world size run in one spawned process group (gloo, CPU, fp32), joined with a
timeout; the references run in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from csbp.runtime.distributed.plans.reference import reference_work
from csbp.runtime.models.model import BlockDiffusionLM
from csbp.runtime.models.objective import make_causal_batch
from csbp.runtime.training.launch import spawn
from csbp.runtime.training.train import Job
from csbp.simulator.commands import cli
from csbp.simulator.layout.layout import Layout, attention_bytes_received
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.plan.rules import AR_NO_BLOCKS
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

# Relative, on the loss and on each weight's gradient as a whole (norm of the difference over the
# norm). Basis: both sides compute in fp32 (unit roundoff 6e-8) but sum in different orders
# (local and received keys merged by their LSE, gradients summed over ranks, dK/dV
# reduce-scattered); reductions over the tiny model's few hundred terms err by about
# sqrt(n) x 6e-8 ~ 1e-6, so 1e-5 leaves a tenfold margin, while a wrong chunk, label or RoPE
# position moves gradients by percents.
TOLERANCE = 1e-5
SPAWN_TIMEOUT_S = 150

TINY = load_model("tiny")
L = 48  # 2cp chunks of C = 12 (cp=2) or 6 (cp=4)
FULL = Workload(seq_len=L, objective="ar", dtype="fp32", checkpointing="full")
NO_RECOMPUTE = FULL.model_copy(update={"checkpointing": "none"})
TWO_PER_REPLICA = FULL.model_copy(update={"micro_batch": 2})


@dataclass(frozen=True)
class Case:
    name: str
    workload: Workload
    plan: str
    transport: str = "collective"
    model: ModelSpec = TINY

    def job(self) -> Job:
        return Job(self.model, self.workload, parse_plan(self.plan, transport=self.transport),
                   capture_gradients=True)


CASES = {
    2: [Case("dp2", FULL, "dp=2"),
        Case("dp2-microbatch2", TWO_PER_REPLICA, "dp=2"),
        Case("tp2", FULL, "tp=2"),
        Case("cp2", FULL, "cp=2"),
        Case("cp2-no-recompute", NO_RECOMPUTE, "cp=2"),
        Case("cp2-ring", FULL, "cp=2", "ring")],
    4: [Case("cp4", FULL, "cp=4"),
        Case("cp4-ring", NO_RECOMPUTE, "cp=4", "ring"),
        Case("dp2-cp2", FULL, "dp=2,cp=2"),
        Case("cp2-tp2", FULL, "cp=2,tp=2")],
}
ALL = [(world, case) for world, cases in CASES.items() for case in cases]


def ids(item):
    return f"world{item[0]}-{item[1].name}"


@cache
def run_world(world: int) -> dict[str, list]:
    """Reports of every case of one world size, by case name (one process group for all)."""
    cases = CASES[world]
    reports = spawn([c.job() for c in cases], world, "cpu", SPAWN_TIMEOUT_S)
    return {c.name: r for c, r in zip(cases, reports)}


def gradients(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.grad.double().numpy() for n, p in model.named_parameters()}


@cache
def reference(workload: Workload, n_sequences: int):
    """The runtime's own single process: the layout's causal mask on positions [L, 2L)."""
    m = BlockDiffusionLM(TINY, seed=0, checkpointing=workload.checkpointing == "full")
    loss = reference_work(TINY, workload, n_sequences).loss(m, step=0, seed=0)
    loss.backward()
    return loss.item(), gradients(m)


def sdpa_causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention (q [B, N, Hq, D], k, v [B, N, Hkv, D]): query head h reads K/V
    head h // (Hq / Hkv), as the runtime groups them."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def independent_causal_loss(n_sequences: int):
    """Next-token loss written out without the layout: tokens 0..L-1 at RoPE positions 0..L-1
    (the model takes positions modulo L), SDPA's causal mask, labels = tokens shifted by one,
    mean over every token of the step."""
    m = BlockDiffusionLM(TINY, seed=0)
    tokens = make_causal_batch(range(n_sequences), 0, 0, L, TINY.vocab)
    hidden = m(tokens[:, :L], torch.arange(L), L, sdpa_causal)
    loss = F.cross_entropy(m.lm_head(hidden).float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), gradients(m)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))


def assert_close(loss: float, grads: dict, ref_loss: float, ref_grads: dict, who: str,
                 slices: dict | None = None) -> None:
    """`slices`: (dim, start, stop) of a TP rank's gradients that are slices of the whole."""
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), f"{who}: loss {loss} vs {ref_loss}"
    assert grads.keys() == ref_grads.keys()
    ref_grads = dict(ref_grads)
    for name, (dim, start, stop) in (slices or {}).items():
        ref_grads[name] = np.take(ref_grads[name], range(start, stop), axis=dim)
    errors = {n: relative_error(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{who}: {worst} off by {errors[worst]:.2e}"


def hand_count(case: Case) -> int:
    """K/V + dK/dV bytes each rank receives in one step, counted by hand: a CP rank holds L/cp
    tokens (chunks r and 2cp-1-r) and needs every other rank's, (cp-1) L/cp K/V rows per layer
    and pass. All-gather: one pass forward, again in the recompute, and the dK/dV reduce-scatter
    home. Ring: cp-1 K/V hops forward and in the recompute; backward K/V go round again and
    dK/dV take cp-1 hops home. A row is K and V of the rank's K/V heads (1/tp of them) in fp32."""
    plan = case.job().plan
    if plan.cp == 1:
        return 0
    recompute = case.workload.checkpointing == "full"
    passes = (3 if plan.transport == "ring" else 2) + recompute
    row = sum(2 * a.n_kv_heads // plan.tp * a.head_dim * 4 for a in case.model.layers)
    return case.workload.micro_batch * passes * (plan.cp - 1) * (L // plan.cp) * row


def test_the_runtime_reference_is_plain_causal_next_token_training():
    """The layout's mask at block 1 and its positions [L, 2L) are causal attention at RoPE
    positions 0..L-1; the labels are the next tokens, every token a loss row."""
    for n in (1, 2):
        assert_close(*independent_causal_loss(n), *reference(NO_RECOMPUTE, n),
                     f"{n} sequences")


@pytest.mark.floats
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_loss_and_every_gradient_match_the_single_process_reference(world, case):
    reports = run_world(world)[case.name]
    plan = case.job().plan
    ref = reference(case.workload, plan.dp * case.workload.micro_batch)
    for r in reports:
        assert_close(r.losses[0], r.gradients, *ref, f"rank {r.rank}", r.gradient_slices)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_counted_bytes_equal_the_step_graphs_and_a_hand_count(world, case):
    reports = run_world(world)[case.name]
    layout = Layout.build(case.workload, case.job().plan)
    by_layout = attention_bytes_received(layout, case.model.layers, case.workload.dtype_bytes,
                                         case.job().plan.tp)
    for r in reports:
        assert r.bytes_received == r.bytes_predicted, f"rank {r.rank}"  # every category
        assert r.bytes_received["attention-kv"] == hand_count(case)
        assert r.bytes_received["attention-kv"] == by_layout[r.ctx_rank] * case.workload.micro_batch
        assert r.attention_received_by_phase == r.attention_predicted_by_phase
    if case.job().plan.cp > 1:
        assert all(r.bytes_received["attention-kv"] > 0 for r in reports)


def csbp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "csbp.simulator.commands.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


RUN = ["run", "--objective", "ar", "--seq-len", "64", "--steps", "1", "--warmup", "0"]


@pytest.mark.timeout(150)
def test_csbp_run_objective_ar_under_cp_reports_matching_bytes():
    done = csbp(*RUN, "--plan", "cp=2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["workload"]["objective"] == "ar" and result["workload"]["block_size"] == 1
    assert result["attention_bytes_counted"] == result["attention_bytes_predicted"] > 0
    assert all(result["bytes_by_category_match"].values()), result["bytes_by_category"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan", ["bp=2", "cp=2,bp=2"])
def test_block_parallel_plans_are_refused_for_ar_in_one_line(plan):
    done = csbp(*RUN, "--plan", plan, timeout=50)
    assert done.returncode == 2
    assert AR_NO_BLOCKS in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_an_emulated_ar_rank_counts_every_collective_as_predicted(capsys):
    argv = [*RUN, "--plan", "dp=2,cp=4", "--emulate-rank", "5", "--layers", "1", "--hardware", "h200",
            "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["collective_bytes_match"], [c for c in out["collectives"]
                                           if c["emulated_bytes"] != c["predicted_bytes"]]
