"""One emulated rank (`csbp run --emulate-rank`) runs what that rank runs in a real multi-process
run: the same attention calls in the same order (query rows, key rows, mask) and the same
collectives moving the same bytes; its report has measured and predicted figures per op.

The real run's ranks are forked from this process so the recorders installed in them (module
attributes patched from outside the runtime) are the ones the emulation runs under.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from csbp.runtime.models import attention as attention_module
from csbp.runtime.distributed.comm import Comm
from csbp.runtime.emulation.emulate import LocalComm, emulate, graph_group
from csbp.runtime.training.train import Job, Trainer
from csbp.simulator.commands import cli
from csbp.simulator.cost.graph import Compute, Op
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload

TINY = load_model("tiny")
SLIDING = ModelSpec(name="tiny-sliding", hidden=64, ffn=128, vocab=256, layers=(
    AttentionSpec(kind="sliding", n_heads=4, n_kv_heads=2, head_dim=16, window=12),
    AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16)))
SEVEN_BLOCKS = Workload(seq_len=56, block_size=8, dtype="fp32")
ATTENTION_FUNCTIONS = ("attend", "tile_backward")  # runtime.attention's kernel entry points
COMM_METHODS = ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "all_reduce")
RANK_TIMEOUT_S = 60


@dataclass(frozen=True)
class Case:
    model: ModelSpec
    plan: str
    transport: str = "collective"
    zero: int = 2  # the workload's default: ZeRO-2 AdamW (gradients reduce-scattered)

    def job(self) -> Job:
        workload = SEVEN_BLOCKS.model_copy(update={"zero_stage": self.zero})
        return Job(self.model, workload, parse_plan(self.plan, transport=self.transport),
                   steps=1, warmup=0)


CASES = {
    "cp2-all-gather": Case(TINY, "cp=2"),
    "cp2-ring": Case(TINY, "cp=2", "ring"),
    "csbp-cp2-bp2-sliding-all-to-all": Case(SLIDING, "cp=2,bp=2"),
    "tp2": Case(TINY, "tp=2"),
    "cp2-replicated-adamw": Case(TINY, "cp=2", zero=0),
}


def record(setter, comm_class, log: list) -> None:
    """Log every attention kernel call (shapes of q and k, and the queries x keys it may see)
    and every collective (its method and the bytes it moved per category), through
    `setter(owner, name, value)`."""
    for name in ATTENTION_FUNCTIONS:
        def kernel(q, k, v, vis, *rest, _real=getattr(attention_module, name), _name=name):
            log.append((_name, tuple(q.shape), tuple(k.shape), tuple(vis.shape)))
            return _real(q, k, v, vis, *rest)
        setter(attention_module, name, kernel)
    for name in COMM_METHODS:
        def call(self, *args, _real=getattr(comm_class, name), _name=name, **kwargs):
            sent, received = dict(self.sent), dict(self.received)
            out = _real(self, *args, **kwargs)
            log.append((_name, tuple((c, self.sent[c] - sent[c], self.received[c] - received[c])
                                     for c in self.sent)))
            return out
        setter(comm_class, name, call)


def _real_rank(rank: int, world: int, init: str, job: Job, conn) -> None:
    try:
        torch.set_num_threads(1)
        log: list = []
        record(setattr, Comm, log)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        Trainer(job, rank, torch.device("cpu")).run()
        conn.send(("ok", log))
    except BaseException as err:  # noqa: BLE001 - the parent must hear of it
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        os._exit(0)  # a forked test process must not run pytest's exit handlers


def real_run_logs(job: Job, tmp_path) -> list[list]:
    """Each rank's log of one step of a real gloo run (forked ranks)."""
    ctx = mp.get_context("fork")
    world = job.plan.world
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_real_rank, args=(r, world, f"file://{tmp_path}/rendezvous", job,
                                                  pipes[r][1])) for r in range(world)]
    for p in procs:
        p.start()
    try:
        logs = []
        for r, (reader, _) in enumerate(pipes):
            assert reader.poll(RANK_TIMEOUT_S), f"rank {r} sent nothing in {RANK_TIMEOUT_S} s"
            status, payload = reader.recv()
            assert status == "ok", f"rank {r}: {payload}"
            logs.append(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return logs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CASES)
def test_an_emulated_rank_runs_the_real_ranks_attention_calls_and_collectives(name, tmp_path,
                                                                              monkeypatch):
    job = CASES[name].job()
    real = real_run_logs(job, tmp_path)
    profile = load_profile("cpu-measured")
    for rank in range(job.plan.world):
        log: list = []
        with monkeypatch.context() as patch:
            record(patch.setattr, LocalComm, log)
            result = emulate(job, rank, torch.device("cpu"), profile)
        assert log == real[rank], f"rank {rank} differs from the real run"
        kernels = [e for e in log if e[0] in ATTENTION_FUNCTIONS]
        moved = [e for e in log if e[0] in COMM_METHODS and any(s or r for _, s, r in e[1])]
        assert kernels and (moved or job.plan.world == 1)
        out = result.to_json()
        assert out["collective_bytes_match"], out["collectives"]


@pytest.mark.timeout(120)
def test_the_report_has_measured_and_predicted_figures_for_every_layer_op():
    job = Case(SLIDING, "cp=2,bp=2").job()
    out = emulate(job, 1, torch.device("cpu"), load_profile("cpu-measured")).to_json()
    assert {"rank", "ops", "measured_peak_memory_gib", "predicted_peak_memory_gib"} <= out.keys()
    assert out["rank"] == 1 and out["ctx_rank"] == 1 and out["measured_peak_memory_gib"] > 0
    ops = {(o["phase"], o["layer"], o["name"]): o for o in out["ops"]}
    for layer in range(job.model.n_layers):
        for phase in ("forward", "recompute", "backward"):
            for name in ("qkv", "attention", "out-proj", "mlp", "elementwise"):
                op = ops[(phase, layer, name)]
                assert op["measured_s"] is not None and op["measured_s"] >= 0, op
                assert op["predicted_s"] > 0, op
    assert ops[("optimizer", None, "optimizer")]["measured_s"] > 0
    assert all({"name", "measured_s", "predicted_s"} <= o.keys() for o in out["ops"])
    assert out["predicted_peak_memory_gib"] > 0 and out["positions"] > 0


def test_graph_ops_are_grouped_by_name_and_kind_including_new_ones():
    def op(name, kind, layer=0, phase="forward"):
        return Op(0, name, phase, layer, Compute(kind, (1.0,), (0.0,)), ())

    assert graph_group(op("qkv", "gemm")) == ("forward", 0, "qkv")
    assert graph_group(op("attn.ring3", "attention-fwd")) == ("forward", 0, "attention")
    assert graph_group(op("kv.copy", "elementwise")) == ("forward", 0, "attention")
    assert graph_group(op("flash-something", "attention-bwd", 1, "backward")) == \
        ("backward", 1, "attention")
    assert graph_group(op("new-gemm", "gemm")) == ("forward", 0, "mlp")
    assert graph_group(op("new-copy", "elementwise")) == ("forward", 0, "elementwise")
    assert graph_group(op("lm-head-bwd", "gemm", None, "backward")) == ("backward", None, "lm-head")
    assert graph_group(op("cross-entropy", "elementwise", None)) == ("step", None, "other")
    assert graph_group(op("adamw", "optimizer", None, "optimizer")) == \
        ("optimizer", None, "optimizer")


SMALL = ["run", "--model", "tiny", "--seq-len", "64", "--block-size", "8", "--plan", "cp=2,bp=2",
         "--steps", "1", "--warmup", "0"]


@pytest.mark.timeout(120)
def test_the_command_prints_one_json_object(capsys):
    assert cli.main([*SMALL, "--emulate-rank", "1", "--layers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rank"] == 1 and out["layers"] == 1 and out["ops"]


@pytest.mark.parametrize("flags, says", [
    (["--emulate-rank", "2"], "ranks 0-1"),
    (["--emulate-rank", "-1"], "ranks 0-1"),
    (["--emulate-rank", "0", "--layers", "3"], "--layers 3"),
    (["--emulate-rank", "x"], "invalid int"),
    (["--hardware", "h200"], "--emulate-rank"),
])
def test_bad_input_is_one_line_and_exit_2(flags, says, capsys):
    assert cli.main([*SMALL, *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.timeout(180)
def test_a_rank_of_a_16_rank_plan_counts_every_collective_as_predicted(capsys):
    """The step's loss all-reduce over 16 ranks moves 2 x 15/16 x 4 = 7.5 bytes a member: the
    comm layer and the step graph round that volume the same way (it once floored it to 7)."""
    argv = ["run", "--model", "tiny", "--seq-len", "1024", "--block-size", "64", "--plan",
            "dp=2,cp=8,bp=8", "--emulate-rank", "3", "--layers", "1", "--hardware", "h200", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["collective_bytes_match"], [c for c in out["collectives"]
                                           if c["emulated_bytes"] != c["predicted_bytes"]]
    loss = [c for c in out["collectives"] if c["category"] == "other"]
    assert [c["emulated_bytes"] for c in loss] == [8]
