"""The validation suite run for real, with the reference probe timed between its rounds.

Why the probe: a shared host's speed moves by several percent within minutes (and by more from
one host to another), so a measured step is the model's error times the host's drift. The
reference probe (`microbench.probe_step_seconds`: the validation model's one-process step at
L = 256, which `csbp calibrate` records as `node.probe_step_s`) is re-timed between rounds, and
each run's step time is read against the probe at its time: scaled by probe_step_s / that probe
time, it is the step the calibrated host would have taken, and its error against the prediction
is the model's alone (`validation_report` reports both).

The mechanism: one round = every plan of one world size once, in one process group; repeats are
further rounds, the world sizes taking turns in mirrored order (2, 4, 4, 2, 2, 4 for three
repeats): a host that slows down during the suite then slows every world size alike instead of
the one whose rounds came last, which would read as a bias of the host model by world size
(issue 26's split). Each run measures at least `MIN_MEASURED_S` of steps (more steps where
the plan's step is short; `steps_for`). The probe runs in this process,
alone on the host, before the first round and after every round. A run's probe time is
interpolated between the two probes that bracket its round, at the run's place in the round
(its runs' durations estimated as median step x steps run) [U: drift is smooth within a
round, one or two minutes].

Why rounds and not every plan: each probe is ~11 steps of 0.15 s (2-8 s on a loaded host) and
each fresh process group costs 3-15 s (torch import, gloo set-up), measured on the 2-core host.
A probe between every plan would start 46 more process groups and 46 more probes in the full
suite (~48 runs), minutes to a suite of ~10; between rounds it adds 4 process groups and 5
probes (about a minute) while no run is further than half a round from a probe. Measured in
the full suite on the 2-core host under load average 6: 7 probes of 0.19-0.33 s steps, rounds
of 95-150 s, 11 minutes in all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from csbp.runtime.validation.validation_suite import VALIDATION_MODEL, Case


@dataclass
class SuiteRuns:
    """What the suite measured: per case, per repeat, the runtime's summary and the probe time
    at that run (None without a probe); and every probe in the order taken."""

    runs: list[list[dict]]
    probe_at_run: list[list[float | None]]
    probes: list[dict]


# seconds of measured steps per run at least: the suite's L = 1024 runs measured about 3 steps
# of 0.7-0.9 s (median step over five validations on the 2-core host) and their run-to-run
# spread was 5-11 % (median per validation), while the L = 512 runs' 3 steps of ~0.3 s spread
# 7-12 %: short plans get as long a window as the long ones had
MIN_MEASURED_S = 2.5
MAX_STEPS = 20  # a plan predicted far too fast must not run for minutes


def steps_for(predicted_s: list[float], steps: int) -> list[int]:
    """Per case, `steps` or more: enough for MIN_MEASURED_S at the predicted step time."""
    return [max(steps, min(MAX_STEPS, math.ceil(MIN_MEASURED_S / p))) if p > 0 else steps
            for p in predicted_s]


def round_order(worlds: list[int], repeats: int) -> list[tuple[int, int]]:
    """(world, round) in the order run: world sizes take turns, mirrored every other round."""
    out = []
    for round_ in range(repeats):
        for world in (worlds if round_ % 2 == 0 else worlds[::-1]):
            out.append((world, round_))
    return out


def measure(cases: list[Case], repeats: int, steps: int | list[int], warmup: int, timeout_s: float,
            progress: Callable[[str], None], probe: Callable[[], float] | None = None) -> SuiteRuns:
    """Run every case `repeats` times, round by round per world size (`round_order`), `probe()`
    between rounds; `steps`: measured steps for every case, or one count per case."""
    from csbp.runtime.training.launch import spawn
    from csbp.runtime.training.train import Job, notes_for, summarize

    out = SuiteRuns([[] for _ in cases], [[] for _ in cases], [])
    start = time.monotonic()

    def take_probe(after: str) -> float | None:
        if probe is None:
            return None
        progress(f"reference probe ({after})")
        seconds = probe()
        out.probes.append({"after": after, "probe_step_s": seconds,
                           "elapsed_s": round(time.monotonic() - start, 1)})
        return seconds

    per_case = steps if isinstance(steps, list) else [steps] * len(cases)
    last = take_probe("start")
    for world, round_ in round_order(sorted({c.plan.world for c in cases}), repeats):
        idx = [i for i, c in enumerate(cases) if c.plan.world == world]
        jobs = [Job(VALIDATION_MODEL, cases[i].workload, cases[i].plan, steps=per_case[i], warmup=warmup)
                for i in idx]
        progress(f"world size {world}: {len(idx)} plans, round {round_ + 1} of {repeats}")
        reports = spawn(jobs, world, "cpu", timeout_s)
        summaries = [summarize(job, rep, "cpu", notes_for(job, "cpu", world))
                     for job, rep in zip(jobs, reports)]
        after = take_probe(f"world size {world}, round {round_ + 1}")
        places = run_places([s["step_time_s"] * (s["warmup"] + s["steps"]) for s in summaries])
        for i, summary, place in zip(idx, summaries, places):
            out.runs[i].append(summary)
            out.probe_at_run[i].append(None if last is None else last + (after - last) * place)
        last = after
    return out


def run_places(durations: list[float]) -> list[float]:
    """Each run's middle as a fraction of its round (runs one after the other)."""
    total = sum(durations)
    if total <= 0:
        return [(k + 0.5) / len(durations) for k in range(len(durations))]
    done, places = 0.0, []
    for d in durations:
        places.append((done + d / 2) / total)
        done += d
    return places
