"""Ranks sharing a host run at the speed of the ranks busy at once (issue 26): a rank that waits
for a peer at a collective leaves its core to the others (gloo blocks the waiting rank's thread:
measured with 2 processes, the waiting rank used 0.01 s of CPU over a 2 s wait), so each op is
priced at the mean number of ranks busy over its interval, not at all the host's ranks.

Synthetic curves and hand-made timelines: no timing on this host.
"""

import numpy as np
import pytest

from csbp.runtime.validation.validation_runs import MAX_STEPS, MIN_MEASURED_S, round_order, steps_for
from csbp.simulator.engine.host_crowding import busy_ranks
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload


def test_busy_ranks_is_the_mean_count_over_each_interval():
    # rank 0 computes [0, 2); rank 1 computes [0, 1) then waits: over rank 0's op 1.5 ranks are
    # busy on average, over rank 1's op 2; an op of rank 0 over [1, 2) alone would see 1
    start = np.array([[0.0, 0.0], [1.0, 1.0]])
    finish = np.array([[2.0, 1.0], [2.0, 1.0]])
    busy = np.array([[True, True], [False, False]])
    got = busy_ranks(start, finish, busy, copies=1)
    assert got[0, 0] == pytest.approx(1.5, rel=1e-12)  # (2 x 1 s + 1 x 1 s) / 2 s
    assert got[0, 1] == pytest.approx(2.0, rel=1e-12)
    assert got[1, 0] == pytest.approx(1.0, rel=1e-12)
    # each representative rank stands for its copies (DP peers busy at the same times)
    assert busy_ranks(start, finish, busy, copies=2)[0, 0] == pytest.approx(3.0, rel=1e-12)


# A host where a second busy rank halves each one's speed: crowding is large and easy to see
STEEP = {c: [[1, 1.0], [2, 0.5], [3, 0.34], [4, 0.25]] for c in ("gemm", "memory", "attention", "host")}
SMALL = ModelSpec(name="crowd", hidden=256, ffn=768, vocab=512,
                  layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=64),) * 2, source="test")
WORK = Workload(seq_len=512, block_size=32, dtype="fp32", zero_stage=0, checkpointing="full")


def _host(world: int):
    base = load_profile("cpu-measured")
    node = base.node.model_copy(update={"rank_speed": STEEP})
    return base.model_copy(update={"node": node, "implementation": "csbp-runtime"}).on_one_host(world)


def _step(plan: str, host) -> float:
    return simulate(SMALL, WORK, parse_plan(plan), host, nodes=1, engine="des", overlap=False).step_time_s


def _static(plan: str, host) -> float:
    """The same graph through the engine with every op priced at all the host's ranks busy (no
    `copies`: the static price)."""
    from csbp.simulator.engine import simulate_graph
    from csbp.simulator.engine.simulate import _step_graph
    from csbp.simulator.layout.layout import Layout
    from csbp.simulator.workload.objectives import as_executed

    p = parse_plan(plan)
    graph = _step_graph(SMALL, WORK, p, Layout.build(as_executed(WORK, SMALL), p), host.node.gpus_per_node,
                        True, host.implementation)
    return simulate_graph(graph, host, "des", overlap=False)[0].step_time_s


def test_ranks_in_step_are_priced_as_all_busy():
    # DP copies run the same ops at the same times: every op sees all ranks busy, as before
    # (the fixed point reads R = 2 for every op: the same shares, so the same step to rounding)
    host = _host(2)
    assert _step("dp=2", host) == pytest.approx(_static("dp=2", host), rel=1e-9)


def test_ranks_that_wait_for_a_peer_speed_the_others_up():
    # pure BP: the rank with the later blocks has more attention work; the others wait for it at
    # every exchange, and while they wait it runs alone, faster than with all ranks busy
    host = _host(4)
    crowded, static = _step("bp=4", host), _static("bp=4", host)
    assert crowded < static * 0.999
    # ... but never faster than with every op alone on the host (each op at 1 rank busy)
    alone = host.model_copy(update={"node": host.node.model_copy(update={"rank_speed": {
        c: [[1, 1.0], [4, 1.0]] for c in STEEP}})})
    assert crowded > _static("bp=4", alone)


def test_profiles_without_curves_are_not_crowded():
    # GPUs and CPU profiles without measured curves keep one price per op (cores / ranks)
    base = load_profile("cpu-measured")
    plain = base.model_copy(update={"node": base.node.model_copy(update={"rank_speed": None}),
                                    "implementation": "csbp-runtime"}).on_one_host(4)
    assert _step("bp=4", plain) == pytest.approx(_static("bp=4", plain), rel=1e-12)


def test_world_sizes_take_turns_in_mirrored_rounds():
    # drift over the suite lands on both world sizes alike: equal counts, and mean positions
    # differing by at most one round's width over three repeats
    order = round_order([2, 4], 3)
    assert order == [(2, 0), (4, 0), (4, 1), (2, 1), (2, 2), (4, 2)]
    assert sorted(order) == sorted((w, r) for w in (2, 4) for r in range(3))


def test_short_plans_measure_more_steps():
    assert steps_for([0.3, 1.0, 3.0], 3) == [9, 3, 3]  # ceil(2.5 / 0.3) = 9
    assert steps_for([0.001], 3) == [MAX_STEPS]
    assert steps_for([0.0], 3) == [3]
    assert all(s * p >= MIN_MEASURED_S for s, p in zip(steps_for([0.3, 0.5], 3), [0.3, 0.5]))
