"""The dependency rule, written once: what must happen before an action may run.

Every consumer (validator, simulator, emulator, runtime, plots) asks this module, so a new action
kind or placement changes one place. Stages are global indices: the rule says which stage's
output an action reads, ``placement`` says on which rank that stage runs.
"""

from __future__ import annotations

from nobubble.core.ir import STEP, Action, B, F, I, W

# The rule as data: a forward on stage s reads the activation of the same micro-batch's forward on
# stage s-1; a backward (fused B, or its input-gradient half I) reads the gradient of the same
# micro-batch's backward of the same kind on stage s+1 (a schedule never mixes B with I and W).
# Kinds not listed (W, STEP) are local. Hot loops (the simulator) read this table directly.
FLOW: dict[str, int] = {F: -1, B: +1, I: +1}


def remote_dependency(action: Action, num_stages: int) -> Action | None:
    """The action on another stage whose output this one consumes, or None."""
    offset = FLOW.get(action.kind)
    if offset is None:
        return None
    source = action.stage + offset
    if 0 <= source < num_stages:
        return Action(source, action.kind, action.number)
    return None


def local_prerequisites(
    action: Action, num_microbatches: int, split_backward: bool = False
) -> list[Action]:
    """Actions on the same stage that must come earlier in that rank's order.

    A backward (B or I) needs its own forward (the saved graph); W needs its I (the output
    gradient and the saved input); step j+1 needs every gradient of batch j, whose sum it applies
    (docs/semantics.md, "Dependency rule"): the B of each micro-batch, or its W when backwards
    are split.
    """
    if action.kind in (B, I):
        return [Action(action.stage, F, action.number)]
    if action.kind == W:
        return [Action(action.stage, I, action.number)]
    if action.kind == STEP:
        first = (action.number - 1) * num_microbatches
        kind = W if split_backward else B
        return [Action(action.stage, kind, m) for m in range(first, first + num_microbatches)]
    return []


def sends_after(action: Action, num_stages: int) -> Action | None:
    """The action on another stage that consumes this action's output, or None (inverse rule)."""
    offset = FLOW.get(action.kind)
    if offset is None:
        return None
    target = action.stage - offset
    if 0 <= target < num_stages:
        return Action(target, action.kind, action.number)
    return None
