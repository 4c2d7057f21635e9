"""Fuzzing bad input: the CLI, and model (config.json), profile (YAML) and plan-file loading.

Every generated input must end in one `csbp: error:` line with exit code 2, or in a normal result
(exit 0, one JSON object, finite numbers; an infeasible plan says why) -- never a traceback, a
hang or a NaN. The CLI runs in-process; `csbp run` stops where it would start processes (inputs
it accepts must fit this host). Inputs are mostly bad on purpose: zero, negative, huge and
non-numeric sizes, lengths that do not divide, degrees that miss the world size, unknown names,
wrong types and malformed files. About 1,300 inputs per run, derandomized so CI sees the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from csbp.runtime.training import launch
from csbp.simulator.commands.cli import main
from csbp.simulator.system.hardware import PROFILE_DIR

SLOW_S = 15  # an input that takes longer than this counts as a hang
SECONDS: list[float] = []  # of every call, for the summary line
CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


class Spawned(BaseException):
    """`csbp run` accepted its input and would start the ranks now."""


def _refuse_to_spawn(jobs, world, device="cpu", timeout_s=600):
    (job,) = jobs
    assert world == job.plan.world and device in ("cpu", "cuda") and 0 < timeout_s < math.inf
    raise Spawned


def _reject_constant(name: str):
    raise AssertionError(f"non-finite number {name} in JSON output")


def call(argv: list[str]) -> str:
    """Run the CLI on `argv`; 'rejected', 'accepted', 'infeasible' or 'spawned', checked."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch.object(launch, "spawn", _refuse_to_spawn):
        try:
            code = main(argv)
        except Spawned:
            code = "spawned"
    seconds = time.perf_counter() - start
    SECONDS.append(seconds)
    assert seconds < SLOW_S, f"{seconds:.1f} s for {argv}"
    stderr = err.getvalue()
    assert "Traceback" not in stderr, stderr
    if code == 2:
        errors = [line for line in stderr.splitlines() if line.startswith("csbp: error: ")]
        assert len(errors) == 1 and stderr.rstrip("\n").endswith(errors[0]), stderr
        assert out.getvalue() == "", out.getvalue()
        return "rejected"
    if code == "spawned":
        return "spawned"
    assert code == 0, (code, stderr)
    result = json.loads(out.getvalue(), parse_constant=_reject_constant)
    if argv[0] == "simulate":
        return _check_simulation(result)
    assert result["recommended"]["feasible"] and result["recommended"]["tokens_per_s"] > 0
    return "accepted"


def _check_simulation(r: dict) -> str:
    if not r["feasible"]:
        assert isinstance(r["reason"], str) and r["reason"], r
        return "infeasible"
    assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0, r
    assert all(m >= 0 for m in r["memory_per_rank_gib"]), r
    return "accepted"


# ---- values: a few good ones, many bad ones --------------------------------------------------

JUNK = st.one_of(
    st.sampled_from(["", " ", "0", "-1", "-7", "1.5", "nan", "inf", "-inf", "1e3", "0x10", "abc",
                     "k", "m", "10^9", "2**63", "9" * 30, "None", "[]", "{}", "é", "a=b",
                     "1,2", "\t"]),
    st.integers(-10**20, 10**20).map(str),
    st.text(max_size=10).filter(lambda s: "\x00" not in s and not s.startswith("-")),
)


def value(good: list[str], bad: list[str] = ()) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(good), st.sampled_from(list(bad) or good), JUNK)


DEGREE = value(["1", "2", "4", "8"], ["0", "-2", "3", "16", "1000000000", "10**9", ""])
PLAN = st.one_of(
    st.lists(st.tuples(st.sampled_from(["dp", "tp", "ep", "cp", "bp", "CP", "xp", " dp", ""]), DEGREE),
             max_size=4).map(lambda terms: ",".join(f"{a}={d}" for a, d in terms)),
    st.sampled_from(["dp=2,cp=8,bp=8", "cp=4,bp=2", "bp=3", "cp=2,bp=6", "dp=8", "cp=1024",
                     "dp=1000000000", "dp", "dp=2,,cp=4", "=2", "dp==2"]),
    JUNK)
WORKLOAD = {
    "--seq-len": value(["64", "512", "4096", "16k"],
                       ["0", "-64", "63", "1.5k", "8m", "5m", "1000000000000000", str(2**70)]),
    "--block-size": value(["8", "16", "64", "256"], ["0", "-8", "7", "3", "1", "10000000000"]),
    "--objective": value(["bd3lm", "fast-dllm-v2", "diffusiongemma", "dflash2"], ["BD3LM", "mdlm"]),
    "--micro-batch": value(["1", "2"], ["0", "-1", "10000000000", "10**12"]),
    "--dtype": value(["bf16", "fp16", "fp32"], ["fp8", "int8"]),
    "--checkpointing": value(["full", "none"], ["selective"]),
    "--zero": value(["0", "1", "2", "3"], ["4", "-1"]),
}
CLUSTER = {
    "--hardware": value(["h100", "h200", "cpu-measured"],
                        ["h300", "/nonexistent.yaml", "hardware_profiles", "README.md", "x/y"]),
    "--nodes": value(["1", "2"], ["0", "-1", "4097", "1000000000", "10**9"]),
}
PLAN_FLAGS = {
    "--plan": PLAN,
    "--transport": value(["collective", "ring"], ["a2a"]),
    "--schedule": value(["dual-end", "contiguous"], ["zigzag"]),
    "--placement": value(["tp,ctx,ep,dp", "dp,ep,ctx,tp"], ["tp,ctx,ep", "tp,tp,ep,dp"]),
}
MODELS = value(["tiny"], ["nemotron-diffusion-8b", "qwen3.5-27b", "diffusiongemma-26b-a4b",
                          "no-such-model", "/nonexistent/config.json", "hardware_profiles", "README.md"])
STRAY = st.lists(st.sampled_from(["--bogus", "-x", "stray", "--json=1", "--plan", "--nodes"]),
                 max_size=1)


def argv(command: str, flags: dict, fixed: list[str], first: tuple[str, ...] = ()
         ) -> st.SearchStrategy[list[str]]:
    """`command`, `first` (defaults the drawn flags override), up to four of `flags` with drawn
    values (few, so that one bad value is often the only one), stray tokens, then `fixed`."""
    @st.composite
    def build(draw):
        out = [command, *first]
        for flag in draw(st.lists(st.sampled_from(sorted(flags)), unique=True, max_size=4)):
            out += [flag, draw(flags[flag])]
        return out + draw(STRAY) + fixed
    return build()


def fuzz(strategy, examples: int, check) -> Counter:
    """Run `check` on `examples` drawn inputs; the outcomes, counted."""
    outcomes: Counter = Counter()
    SECONDS.clear()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=CHECKS)
    @given(strategy)
    def each(example):
        outcomes[check(example)] += 1

    each()
    print(f"{sum(outcomes.values())} inputs: {dict(outcomes)}, slowest {max(SECONDS):.2f} s")
    return outcomes


@pytest.mark.timeout(120)
def test_simulate_flags():
    flags = WORKLOAD | CLUSTER | PLAN_FLAGS | {"--model": MODELS}
    seen = fuzz(argv("simulate", flags, ["--engine", "closed-form", "--json"]), 400, call)
    assert seen["rejected"] > 200 and seen["accepted"] > 5


@pytest.mark.timeout(120)
def test_plan_flags():
    small = {"--model": value(["tiny"], ["no-such-model", "/nonexistent/config.json"]),
             "--seq-len": value(["64", "1024"], ["0", "63", "8m", "1000000000000000"]),
             "--nodes": value(["1"], ["0", "-1", "4097", "1000000000"]),
             "--axes": value(["dp,cp,bp", "dp,tp,ep,cp,bp"], ["", "dp,xp", "DP"]),
             "--top": value(["3"], ["0", "-1"])}
    flags = WORKLOAD | CLUSTER | small
    # a valid search for the default job takes seconds: fuzz the tiny model at small contexts on
    # one node (what is fuzzed is the input handling; a valid search of 8 GPUs at 1K tokens costs
    # a fifth of one of 16 GPUs at 4K, and the test draws a few dozen valid ones)
    plans = argv("plan", flags, ["--engine", "closed-form", "--jobs", "1", "--json"],
                 first=("--model", "tiny", "--seq-len", "1024", "--nodes", "1"))
    seen = fuzz(plans, 150, call)
    assert seen["rejected"] > 100 and seen["accepted"] > 0


@pytest.mark.timeout(120)
def test_run_flags(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    run_flags = {
        "--model": value(["tiny"], ["no-such-model", "qwen3.5-27b", "nemotron-diffusion-8b"]),
        "--seq-len": value(["64", "256"], ["0", "63", "1m", "4m", "1000000000000000"]),
        "--plan": PLAN,
        "--steps": value(["1", "3"], ["0", "-1"]),
        "--warmup": value(["0", "1"], ["-1"]),
        "--seed": value(["0", "7"]),
        "--device": value(["cpu", "auto"], ["cuda", "tpu"]),
        "--timeout": value(["30"], ["0", "-5", "nan", "inf"]),
        "--checkpoint-dir": value([str(tmp_path / "ck")], ["/proc/no/such/dir"]),
        "--checkpoint-every": value(["2"], ["0", "-1"]),
        "--resume": value([str(tmp_path / "empty")], [str(tmp_path / "file"), "/nonexistent"]),
    }
    flags = {k: v for k, v in (WORKLOAD | PLAN_FLAGS).items() if k != "--dtype"} | run_flags
    seen = fuzz(argv("run", flags, []), 200, call)
    assert seen["rejected"] > 150 and seen["spawned"] > 0


# ---- files: a valid base, mutated at random paths, or not even the right syntax -------------

def _paths(tree, prefix=()):
    """Every path into a JSON-like tree (dict keys and list indices), the root included."""
    yield prefix
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


JSON_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**18, 10**18),
              st.sampled_from([0, -1, 10**7, 10**9, 10**15, 2**64, 0.5, -2.5, 1e300]),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


SCALES = [0, -1, 2, 1e-9, 1e9, 10**15, 1e300]


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@st.composite
def mutated(draw, base: dict, keys: list[str]):
    """`base` with one to three changes: a value replaced by junk, a key dropped or added."""
    tree = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(tree) if p]
        if not paths:  # everything dropped already (or replaced by an empty container)
            break
        path = draw(st.sampled_from(paths))
        parent = _at(tree, path[:-1])
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(JSON_JUNK)
        elif action == "drop":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(keys) | st.text(max_size=6))] = draw(JSON_JUNK)
    return tree


def scale(number: int | float, factor: int | float) -> int | float:
    """`number * factor` as a file would hold it: an int stays an exact int while the factor is
    one; anything past a float's range becomes inf (the loaders must refuse it), never an
    OverflowError inside the strategy."""
    if type(number) is int and type(factor) is int:
        return number * factor
    try:
        product = float(number) * float(factor)
    except OverflowError:  # an int beyond a float's range
        product = math.copysign(math.inf, number) * math.copysign(1.0, factor) if factor else 0.0
    exact = type(number) is int and math.isfinite(product)
    return int(product) if exact else product


@st.composite
def scaled(draw, base: dict):
    """`base` with one or two of its numbers scaled: to zero, negative, tiny or huge."""
    tree = json.loads(json.dumps(base))
    numbers = [p for p in _paths(tree) if p and type(_at(tree, p)) in (int, float)]
    # the same number may be drawn twice: 64 * 1e300 * 1e300 must be a file, not an error
    for path in draw(st.lists(st.sampled_from(numbers), min_size=1, max_size=2)):
        _at(tree, path[:-1])[path[-1]] = scale(_at(tree, path), draw(st.sampled_from(SCALES)))
    return tree


def files(bases: list[dict], keys: list[str]) -> st.SearchStrategy:
    """Mutated and scaled versions of `bases`, and files that are not even the right syntax."""
    return st.one_of(*(mutated(b, keys) for b in bases), *(scaled(b) for b in bases), RAW_JUNK)


RAW_JUNK = st.one_of(
    st.sampled_from([b"", b"{", b"[1, 2", b'{"a": }', b"null", b"42", b"[]", b'"text"', b"\xff\xfe\x00",
                     b"[" * 5_000, b"a: b: c", b"- [", b"\t- x\n  y", b"{value: 1, source: }"]),
    st.binary(max_size=40))


def write_file(tmp_path: Path, name: str, content, dump) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else dump(content).encode())
    return path


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256, "tie_word_embeddings": False}
HF_BASES = [
    LLAMA,
    LLAMA | {"sliding_window": 16, "sliding_window_pattern": 2, "layer_types": None},
    LLAMA | {"layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 4,
             "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_conv_kernel_dim": 4},
    LLAMA | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32, "intermediate_size": None},
    {"model_type": "gemma3", "text_config": LLAMA | {"full_attention_interval": 2}},
]
HF_KEYS = sorted({k for b in HF_BASES for k in b} | {"n_shared_experts", "n_routed_experts",
                                                    "global_head_dim", "use_sliding_window"})


def test_scale_never_raises():
    """Every chain of two scales from every kind of number a base holds gives a number."""
    for start in (0, 1, 64, -3, 2**70, 0.5, 1e-300, 1e300):
        for first in SCALES:
            for second in SCALES:
                out = scale(scale(start, first), second)
                assert type(out) in (int, float)
                json.dumps(out)  # what the file writers do with it
    assert scale(64, 10**15) == 64 * 10**15 and type(scale(64, 2)) is int
    assert scale(int(64 * 1e300), 1e300) == math.inf


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["hf", "hardware", "plan"])
def test_file_strategies_never_raise(name):
    """The strategies themselves: drawing thousands of inputs raises nothing (an error inside a
    strategy is a failing test on a correct tree, the day a dependency draws other examples)."""
    strategy = {"hf": lambda: files(HF_BASES, HF_KEYS), "hardware": lambda: files([_h200()], ["name"]),
                "plan": lambda: files(PLAN_BASES, PLAN_KEYS)}[name]()
    drawn = []

    @settings(max_examples=2000, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=CHECKS)
    @given(strategy)
    def each(example):
        drawn.append(example if isinstance(example, bytes) else json.dumps(example))

    each()
    assert len(drawn) >= 1000


@pytest.mark.timeout(120)
def test_model_config_files(tmp_path):
    def check(content) -> str:
        path = write_file(tmp_path, "config.json", content, json.dumps)
        return call(["simulate", "--model", str(path), "--seq-len", "4096", "--block-size", "64",
                     "--nodes", "1", "--plan", "dp=8", "--engine", "closed-form", "--json"])

    seen = fuzz(files(HF_BASES, HF_KEYS), 250, check)
    assert seen["rejected"] > 100 and seen["accepted"] > 10


def _h200() -> dict:
    return yaml.safe_load((PROFILE_DIR / "h200.yaml").read_text())


YAML_BOMB = b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" \
            b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n" \
            b"name: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"


@pytest.mark.timeout(120)
def test_hardware_profile_files(tmp_path):
    base = _h200()

    def check(content) -> str:
        path = write_file(tmp_path, "profile.yaml", content, yaml.safe_dump)
        return call(["simulate", "--hardware", str(path), "--model", "tiny", "--seq-len", "4096",
                     "--block-size", "64", "--nodes", "1", "--plan", "dp=8", "--engine",
                     "closed-form", "--json"])

    keys = sorted({p[-1] for p in _paths(base) if p and isinstance(p[-1], str)})
    seen = fuzz(files([base], keys) | st.just(YAML_BOMB), 250, check)
    assert seen["rejected"] > 150 and seen["accepted"] >= 5


INLINE = {"name": "inline", "hidden": 32, "ffn": 64, "vocab": 64,
          "layers": [{"n_heads": 2, "n_kv_heads": 1, "head_dim": 16}]}
PLAN_WORKLOAD = {"seq_len": 64, "block_size": 8, "dtype": "fp32"}
PLAN_BASES = [{"version": 1, "model": "tiny", "workload": PLAN_WORKLOAD, "plan": {"cp": 2}},
              {"version": 1, "model": INLINE, "workload": PLAN_WORKLOAD, "plan": {"cp": 2, "bp": 2},
               "hardware": "h200", "nodes": 1, "prediction": {}}]
PLAN_KEYS = ["version", "model", "workload", "plan", "hardware", "nodes", "prediction", "seq_len",
             "block_size", "dp", "cp", "bp", "tp", "layers", "moe", "window", "kind"]


@pytest.mark.timeout(120)
def test_plan_files(tmp_path):
    def check(content) -> str:
        path = write_file(tmp_path, "plan.json", content, json.dumps)
        return call(["run", "--plan", str(path)])

    seen = fuzz(files(PLAN_BASES, PLAN_KEYS), 250, check)
    assert seen["rejected"] > 150 and seen["spawned"] >= 3
