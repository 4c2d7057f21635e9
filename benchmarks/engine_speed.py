"""Engine speed: DES wall time for 1024-GPU plans, and closed-form evaluations per second.

Goal (issue 2): a 1024-GPU step simulates in <= 10 s on 2 cores. Run:
    python benchmarks/engine_speed.py
"""

from __future__ import annotations

import os
import time

from csbp.simulator.engine import simulate_graph
from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.workload.workload import Workload

MODEL = "nemotron-diffusion-8b"
SEQ_LEN = 256 * 1024
PLANS = (Plan(dp=64, cp=16), Plan(dp=128, cp=8, bp=8))


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - start) / repeat, out


def main() -> None:
    model, profile = load_model(MODEL), load_profile("h200")
    workload = Workload(seq_len=SEQ_LEN)
    print(f"{MODEL}, L={SEQ_LEN // 1024}K, 128 nodes x 8 H200 (1024 GPUs), {os.cpu_count()} cores")
    for plan in PLANS:
        wall, result = timed(lambda: simulate(model, workload, plan, profile, nodes=128, engine="des"))
        layout = Layout.build(workload, plan)
        graph = StepGraph.build(model, workload, plan, layout, profile.node.gpus_per_node)
        des_only, _ = timed(lambda: simulate_graph(graph, profile, "des"))
        print(f"  {plan.label():18s} simulate(des): {wall:6.2f} s wall  (engine alone {des_only:.2f} s, "
              f"{graph.ranks} representative ranks x {len(graph.ops)} ops); "
              f"step {result.step_time_s:.2f} s, {result.tokens_per_s:,.0f} tokens/s")
        per_eval, _ = timed(lambda: simulate_graph(graph, profile, "closed-form"), repeat=5)
        full, _ = timed(lambda: simulate(model, workload, plan, profile, nodes=128, engine="closed-form",
                                         with_trace=False), 3)
        print(f"  {'':18s} closed form: {1 / per_eval:6.1f} evaluations/s on a built graph, "
              f"{1 / full:5.1f} /s for the whole simulate() (layout + graph + memory)")


if __name__ == "__main__":
    main()
