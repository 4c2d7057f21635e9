"""The CSBP study regenerated from the planner's own choices: one module per study (a-f).

Each study module has NAME, TITLE, ASSUMPTIONS, UNVERIFIED and `run(runner, out) -> StudyOutput`;
`experiments.cli` runs them and `experiments.report` writes the CSVs, plots and summary.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

STUDIES = {  # name -> module, in the order of the paper's studies
    "a-256k": "csbp.experiments.a_256k",
    "b-scaling": "csbp.experiments.b_scaling",
    "c-drafters": "csbp.experiments.c_drafters",
    "d-pure-bp": "csbp.experiments.d_pure_bp",
    "e-schedule": "csbp.experiments.e_schedule",
    "f-profile": "csbp.experiments.f_profile",
}


@dataclass
class StudyOutput:
    rows: list[dict]
    columns: list[tuple[str, str]]  # (row key, header) shown in summary.md; the CSV has every key
    findings: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # file names under the results folder


def load(name: str):
    """The study module for a name or its letter ('c' -> c-drafters)."""
    from csbp.simulator.errors import InputError

    match = [n for n in STUDIES if n == name or n.split("-")[0] == name]
    if not match:
        raise InputError(f"unknown study {name!r}: use all or one of {', '.join(STUDIES)}")
    return importlib.import_module(STUDIES[match[0]])
