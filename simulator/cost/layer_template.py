"""Layers of one kind append the same ops: record the first, stamp the rest with shifted indices.

The builder's logic then runs once per layer kind and pass, not once per layer (a 64-layer model
with one kind builds one layer and copies it 63 times).
"""

from __future__ import annotations

from dataclasses import dataclass

from csbp.simulator.cost.step_ops import Deps, Op, Phase, Work

Relative = tuple[bool, tuple[int, ...]]  # (after the layer's input?, after these ops of the layer)

@dataclass(frozen=True)
class _LayerTemplate:
    """The ops one layer appended, with dependencies relative to its input and its first op."""

    ops: tuple[tuple[str, Phase, Work, Relative], ...]
    out: Relative

    @classmethod
    def record(cls, ops: list[Op], start: int, x: Deps, out: Deps) -> "_LayerTemplate | None":
        """None if some op waits for only part of the input (then the layer cannot be stamped)."""
        inputs = set(x)

        def relative(deps: Deps) -> Relative | None:
            outer = {d for d in deps if d < start}
            inner = tuple(sorted({d - start for d in deps if d >= start}))
            return (bool(outer), inner) if outer in (set(), inputs) else None

        rel = [relative(op.deps) for op in ops] + [relative(out)]
        if None in rel:
            return None
        return cls(tuple((op.name, op.phase, op.work, r) for op, r in zip(ops, rel)), rel[-1])

    def stamp(self, ops: list[Op], layer: int, x: Deps) -> Deps:
        """Append a copy for `layer` after input `x`; returns the ops that end it (as a set).
        Most ops wait for the one op before them: that tuple is made without a map."""
        base, inputs = len(ops), tuple(sorted(set(x)))  # inputs precede every op of the layer
        new, k, out = tuple.__new__, base, []
        for name, phase, work, (after_input, inner) in self.ops:
            if after_input:
                deps = inputs + tuple([base + d for d in inner]) if inner else inputs
            elif len(inner) == 1:
                deps = (base + inner[0],)
            else:
                deps = tuple([base + d for d in inner])
            out.append(new(Op, (k, name, phase, layer, work, deps)))
            k += 1
        ops.extend(out)
        after_input, inner = self.out
        return (inputs if after_input else ()) + tuple([base + d for d in inner])
