"""The dependency rule, written once: what must happen before an action may run.

Every consumer (validator, simulator, emulator, runtime, plots) asks this module, so a new action
kind or placement changes one place.
"""

from __future__ import annotations

from nobubble.core.ir import STEP, Action, B, F

# The rule as data: a forward on stage s reads the activation of the same micro-batch's forward on
# stage s-1; a backward reads the gradient of the same micro-batch's backward on stage s+1. Kinds
# not listed (STEP) are local. Hot loops (the simulator) read this table directly.
FLOW: dict[str, int] = {F: -1, B: +1}


def remote_dependency(action: Action, num_stages: int) -> Action | None:
    """The action on another stage whose output this one consumes, or None."""
    offset = FLOW.get(action.kind)
    if offset is None:
        return None
    source = action.stage + offset
    if 0 <= source < num_stages:
        return Action(source, action.kind, action.number)
    return None


def local_prerequisites(action: Action, num_microbatches: int) -> list[Action]:
    """Actions on the same stage that must come earlier in that rank's order.

    A backward needs its own forward (the saved graph); step j+1 needs every backward of batch j,
    whose gradients it applies (design.md section 2).
    """
    if action.kind == B:
        return [Action(action.stage, F, action.number)]
    if action.kind == STEP:
        first = (action.number - 1) * num_microbatches
        return [Action(action.stage, B, m) for m in range(first, first + num_microbatches)]
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
