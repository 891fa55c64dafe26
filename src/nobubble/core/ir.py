"""Schedules as plain data: actions, per-rank orders, text and JSON forms, the grid printer.

A schedule is, for each rank, an ordered tuple of small immutable actions. The per-rank order plus
the schedule's two weight rules (which version a forward reads, which a backward reads) fix the
numerics completely; time is added later by the simulator or by the real runtime.

Text form of one action: ``<stage><KIND><index>``, e.g. ``1F3`` (forward of micro-batch 3 on stage
1), ``0B2`` (backward), ``2STEP1`` (stage 2's first optimizer step, which creates version 1).

The backward is either fused (``B``) or split, as zero-bubble schedules need, into ``I`` (the
gradient with respect to the stage input, which the previous stage waits for) and ``W`` (the
gradient with respect to the stage weights, which only the stage's own step waits for): ``0I2``,
``0W2``. A schedule fuses every backward or splits every one. A stage runs on the rank its
``placement`` names (one stage per rank unless the schedule says otherwise).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from nobubble.core.placement import Placement, one_per_rank

# Action kinds. Plain strings keep actions cheap to build and hash (a P=64, M=256, 100-step
# schedule holds ~3.3M actions); SEND/RECV are reserved for explicitly lowered schedules.
F = "F"
B = "B"
STEP = "STEP"
I = "I"  # the zero-bubble papers' name for the input-gradient half of B
W = "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
KINDS = (F, B, STEP, SEND_F, RECV_F, SEND_B, RECV_B, I, W)
COMPUTE_KINDS = (F, B, STEP, I, W)

# Which weight version a forward reads, and which a backward reads (docs/semantics.md, "Schedule
# fields").
FORWARD_RULES = ("current", "previous_batch")
BACKWARD_RULES = ("current", "stashed")

_ACTION_RE = re.compile(r"^(\d+)(STEP|SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class ScheduleError(ValueError):
    """A schedule, action text or schedule file is malformed or breaks a rule."""


class Action(NamedTuple):
    """One unit of work on one stage; ``number`` is the micro-batch (F, B) or the step (STEP)."""

    stage: int
    kind: str
    number: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.number}"

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"malformed action {text!r}: expected <stage><KIND><index> with KIND one of "
                f"{', '.join(KINDS)}, e.g. '1F3', '0B2' or '2STEP1'"
            )
        return Action(int(match.group(1)), match.group(2), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action orders plus the weight rules that give them their numerics.

    ``num_microbatches`` is M, the micro-batches one optimizer step applies (for ``pipedream`` and
    ``paci`` it is the accumulation factor ``a``). ``placement`` says which rank runs each stage
    (default: stage s on rank s); ``ranks`` holds one order per rank, each naming its stages.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_steps: int
    forward_rule: str
    backward_rule: str
    ranks: tuple[tuple[Action, ...], ...]
    drain_every: int | None = None
    sync_warmup: int = 0  # the first steps run synchronously (flush), as 1f1b
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # None means one stage per rank; __post_init__ replaces it, so readers always see a Placement.
    placement: Placement = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.forward_rule not in FORWARD_RULES:
            raise ScheduleError(
                f"forward_rule {self.forward_rule!r} is not one of {', '.join(FORWARD_RULES)}"
            )
        if self.backward_rule not in BACKWARD_RULES:
            raise ScheduleError(
                f"backward_rule {self.backward_rule!r} is not one of {', '.join(BACKWARD_RULES)}"
            )
        for label, value in (
            ("num_stages", self.num_stages),
            ("num_microbatches", self.num_microbatches),
            ("num_steps", self.num_steps),
        ):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{label} must be an integer >= 1, got {value!r}")
        if self.placement is None:
            object.__setattr__(self, "placement", one_per_rank(self.num_stages))
        if self.placement.num_stages != self.num_stages:
            raise ScheduleError(
                f"schedule {self.name!r} has {self.num_stages} stages but its placement holds "
                f"{self.placement.describe()}"
            )
        if len(self.ranks) != self.placement.num_ranks:
            raise ScheduleError(
                f"schedule {self.name!r} has {len(self.ranks)} rank orders for "
                f"{self.placement.describe()}; give one order per rank"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @cached_property
    def split_backward(self) -> bool:
        """Whether backwards are split into I and W (rank 0 decides; the validator checks the
        rest never mixes B with I and W)."""
        return any(kind in (I, W) for _, kind, _ in self.ranks[0]) if self.ranks else False

    @property
    def gradient_kind(self) -> str:
        """The action that completes a micro-batch's weight gradient on a stage: B, or W."""
        return W if self.split_backward else B

    @property
    def total_microbatches(self) -> int:
        return self.num_microbatches * self.num_steps

    def batch_of(self, microbatch: int) -> int:
        return microbatch // self.num_microbatches

    def num_actions(self) -> int:
        return sum(len(order) for order in self.ranks)

    # ----- text form -------------------------------------------------------------------------
    def header(self) -> str:
        drain = "none" if self.drain_every is None else str(self.drain_every)
        where = self.placement
        placed = "" if where.kind == "one" else f" placement={where.kind} ranks={where.num_ranks}"
        return (
            f"# nobubble schedule name={self.name} stages={self.num_stages} "
            f"microbatches={self.num_microbatches} steps={self.num_steps} "
            f"forward={self.forward_rule} backward={self.backward_rule} drain_every={drain} "
            f"sync_warmup={self.sync_warmup}{placed}"
        )

    def to_text(self) -> str:
        lines = [self.header()]
        lines += [f"rank {r}: " + " ".join(map(str, order)) for r, order in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(text: str) -> Schedule:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        if not lines or not lines[0].startswith("# nobubble schedule"):
            raise ScheduleError(
                "schedule text must start with a '# nobubble schedule key=value ...' header line"
            )
        fields = dict(item.split("=", 1) for item in lines[0].split()[3:] if "=" in item)
        ranks = []
        for expected, line in enumerate(lines[1:]):
            prefix, _, body = line.partition(":")
            if prefix.strip() != f"rank {expected}":
                raise ScheduleError(f"line {expected + 2}: expected 'rank {expected}: ...'")
            ranks.append(tuple(Action.parse(tok) for tok in body.split()))
        try:
            return Schedule(
                name=fields["name"],
                num_stages=int(fields["stages"]),
                num_microbatches=int(fields["microbatches"]),
                num_steps=int(fields["steps"]),
                forward_rule=fields["forward"],
                backward_rule=fields["backward"],
                ranks=tuple(ranks),
                drain_every=None
                if fields.get("drain_every", "none") == "none"
                else int(fields["drain_every"]),
                **_placement(fields.get("placement"), fields.get("ranks"), fields["stages"]),
            )
        except KeyError as err:
            raise ScheduleError(f"schedule header lacks the field {err.args[0]!r}") from None

    # ----- JSON form -------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_steps": self.num_steps,
            "forward_rule": self.forward_rule,
            "backward_rule": self.backward_rule,
            "drain_every": self.drain_every,
            "sync_warmup": self.sync_warmup,
            **(
                {}
                if self.placement.kind == "one"
                else {"placement": self.placement.kind, "num_ranks": self.placement.num_ranks}
            ),
            "ranks": [[str(a) for a in order] for order in self.ranks],
        }

    @staticmethod
    def from_json(obj: Any) -> Schedule:
        if not isinstance(obj, dict):
            raise ScheduleError(f"schedule JSON must be an object, got {type(obj).__name__}")
        required = ("name", "num_stages", "num_microbatches", "num_steps", "ranks")
        missing = [key for key in required if key not in obj]
        if missing:
            raise ScheduleError(
                f"schedule JSON lacks {', '.join(missing)}; required keys: {', '.join(required)}"
            )
        ranks = obj["ranks"]
        if not isinstance(ranks, list) or not all(isinstance(r, list) for r in ranks):
            raise ScheduleError("'ranks' must be a list of lists of action strings like '0F1'")
        return Schedule(
            name=str(obj["name"]),
            num_stages=obj["num_stages"],
            num_microbatches=obj["num_microbatches"],
            num_steps=obj["num_steps"],
            forward_rule=obj.get("forward_rule", "current"),
            backward_rule=obj.get("backward_rule", "current"),
            drain_every=obj.get("drain_every"),
            sync_warmup=int(obj.get("sync_warmup", 0)),
            ranks=tuple(tuple(Action.parse(str(a)) for a in order) for order in ranks),
            **_placement(obj.get("placement"), obj.get("num_ranks"), obj["num_stages"]),
        )

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load_json(path: str | Path) -> Schedule:
        path = Path(path)
        if not path.is_file():
            raise ScheduleError(f"schedule file {str(path)!r} does not exist")
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ScheduleError(f"schedule file {str(path)!r} is not valid JSON: {err}") from None
        return Schedule.from_json(obj)


def _placement(kind: Any, num_ranks: Any, num_stages: Any) -> dict[str, Any]:
    """The ``placement`` argument a text or JSON form names (none: one stage per rank), or a
    ScheduleError when it does not fit."""
    if kind is None or kind == "one":
        return {}
    try:
        ranks, stages = int(num_ranks), int(num_stages)
        if ranks < 1 or stages % ranks:
            raise ValueError(
                f"{stages} stages cannot be placed evenly on {ranks} ranks; give a rank count "
                "that divides the stage count"
            )
        return {"placement": Placement(str(kind), ranks, stages // ranks)}
    except (TypeError, ValueError) as err:
        raise ScheduleError(f"bad placement {kind!r} with ranks={num_ranks!r}: {err}") from None


def format_grid(
    ranks: Sequence[Sequence[Action]],
    mark: tuple[int, int] | None = None,
    max_columns: int = 48,
) -> str:
    """ASCII grid: one row per rank, one column per position; ``mark=(rank, pos)`` is bracketed.

    Long orders are windowed around the marked cell (or show the start) so errors stay readable.
    """
    length = max((len(o) for o in ranks), default=0)
    start = 0
    if mark is not None and length > max_columns:
        start = max(0, min(mark[1] - max_columns // 2, length - max_columns))
    stop = min(length, start + max_columns)
    cells = [
        [str(order[p]) if p < len(order) else "." for p in range(start, stop)] for order in ranks
    ]
    if mark is not None and mark[1] >= stop:  # marked position past the end of that rank's order
        stop = mark[1] + 1
    width = max([len(c) for row in cells for c in row] + [3]) + 2
    header = "pos    " + "".join(f"{p:^{width}}" for p in range(start, stop))
    lines = [header]
    for r, row in enumerate(cells):
        texts = []
        for offset, cell in enumerate(row):
            pos = start + offset
            texts.append(f"[{cell}]" if mark == (r, pos) else f" {cell} ")
        if mark is not None and mark[0] == r and mark[1] >= start + len(row):
            texts.append("[?]")
        lines.append(f"rank {r:<2}" + "".join(f"{t:^{width}}" for t in texts))
    if start > 0 or stop < length:
        lines.append(f"(positions {start}..{stop - 1} of {length})")
    return "\n".join(lines)
