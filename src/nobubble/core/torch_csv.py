"""torch.distributed.pipelining's CSV schedule format, in and out (torch-free).

torch's ``_PipelineScheduleRuntime`` loads and dumps a schedule as CSV (``_load_csv``,
``_dump_csv``): one row per rank, one cell per time step, each cell an action of one batch, i.e.
one optimizer step: ``0F1`` (forward of micro-batch 1 on stage 0), ``1B0`` (fused backward),
``1I0`` and ``1W0`` (its input- and weight-gradient halves), or a composite such as
``(0F3;3B1)OVERLAP_F_B`` (DualPipeV's forward of one micro-batch overlapped with the backward of
another). An empty cell is an idle step. torch runs the same rows at every ``step()``.

Reading (``from_torch_csv``) keeps the compute actions in row order: a composite becomes its
sub-actions one after the other (nobubble has no overlap; a rank runs them in sequence), and a
schedule that splits any backward splits every one, so a fused ``B`` there becomes ``I`` then
``W`` right after it, the same work in the same order. ``REDUCE_GRAD``, ``UNSHARD`` and
``RESHARD`` (data-parallel and FSDP hooks) and torch's communication actions (``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B``, the "compute_comms" form) are dropped: nobubble derives its
transfers from the dependency rule and orders them itself (core/sender_order.py), which is not
torch's lowering (``_add_send_recv`` puts each send right after its producer and each receive
right before its consumer, per action), so nobubble writes the compute-only form only. The
placement (one stage per rank, a loop or a V) is read from which stages each row runs; every
rank's batch ends with one STEP per stage, and ``num_steps`` batches repeat the rows.

Writing (``to_torch_csv``) needs a synchronous schedule whose batches all run the same order:
asynchronous schedules are refused, because their weight rules (which version a forward or
backward reads, steps between a micro-batch's forward and backward) have no column in torch's
format, which knows one batch per step, flushed.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from nobubble.core.ir import STEP, Action, B, F, I, Schedule, ScheduleError, W
from nobubble.core.placement import PLACEMENTS, Placement
from nobubble.core.program import one_batch
from nobubble.core.schedules import SCHEDULES
from nobubble.core.validate import ScheduleValidationError, validate

# torch's action kinds that carry no compute nobubble schedules: data-parallel and FSDP hooks, and
# the communication of the "compute_comms" form (nobubble derives its own transfers).
DROPPED = ("REDUCE_GRAD", "UNSHARD", "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
OVERLAP = "OVERLAP_F_B"
_CELL_RE = re.compile(
    r"^(\d+)(REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)(\d*)$"
)
_COMPOSITE_RE = re.compile(r"^\(([^()]*)\)([A-Z_]+)$")


class TorchCsvError(ScheduleError):
    """A torch CSV schedule cannot be read, or a schedule cannot be written as one."""


# ----- writing ------------------------------------------------------------------------------------
def torch_rows(schedule: Schedule) -> list[list[str]]:
    """Batch 0's compute actions of each rank, as torch's cells; TorchCsvError (naming why) when
    ``schedule`` is not one flushed batch repeated, the only shape torch's format holds."""
    info = SCHEDULES.get(schedule.name)
    rules = (schedule.forward_rule, schedule.backward_rule)
    if (info is not None and not info.synchronous) or rules != ("current", "current"):
        sync = ", ".join(n for n, i in SCHEDULES.items() if i.synchronous)
        raise TorchCsvError(
            f"schedule {schedule.name!r} is asynchronous (forward={rules[0]}, "
            f"backward={rules[1]}, steps between a micro-batch's forward and backward): its "
            "weight rules have no column in torch's CSV format, which runs one flushed batch "
            f"per step; write a synchronous schedule ({sync})"
        )
    try:
        rows = one_batch(schedule)
    except ScheduleError as err:
        raise TorchCsvError(
            f"schedule {schedule.name!r}: {err}; torch runs the same rows at every step, one "
            "flushed batch between two steps, so only synchronous schedules whose batches "
            "repeat can be written (or --steps 1)"
        ) from None
    return [[str(a) for a in row] for row in rows]


def to_torch_csv(schedule: Schedule) -> str:
    """``schedule`` in torch's compute-only CSV form: one row per rank, one batch."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(torch_rows(schedule))
    return out.getvalue()


def save_torch_csv(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(to_torch_csv(schedule))


# ----- reading ------------------------------------------------------------------------------------
def _parse_cell(text: str, rank: int, step: int) -> list[Action]:
    """The compute actions of one cell, in order (none for an idle step or a dropped kind)."""

    def bad(reason: str) -> TorchCsvError:
        return TorchCsvError(f"torch CSV: rank {rank}, step {step}, cell {text!r}: {reason}")

    text = text.strip()
    if not text:
        return []
    composite = _COMPOSITE_RE.match(text)
    if composite is not None:
        if composite.group(2) != OVERLAP:
            raise bad(f"composite kind {composite.group(2)!r} is not {OVERLAP}")
        parts = [p for p in composite.group(1).split(";") if p.strip()]
        out = [a for part in parts for a in _parse_cell(part, rank, step)]
        if len(out) != len(parts):
            raise bad(f"{OVERLAP} holds compute actions only, e.g. '(0F3;3B1){OVERLAP}'")
        return out
    match = _CELL_RE.match(text)
    if match is None:
        raise bad(
            "expected <stage><KIND><micro-batch> with KIND one of F, B, I, W (or a "
            f"'(0F3;3B1){OVERLAP}' composite, or one of {', '.join(DROPPED)})"
        )
    stage, kind, number = match.groups()
    if kind in DROPPED:
        return []
    if not number:
        raise bad(f"{kind} needs a micro-batch index, e.g. '{stage}{kind}0'")
    return [Action(int(stage), kind, int(number))]


class _Rows:
    """Parsed rows: each rank's compute actions and, for each, the cell it came from."""

    def __init__(self, text: str) -> None:
        rows = list(csv.reader(io.StringIO(text)))
        while rows and not any(cell.strip() for cell in rows[-1]):
            rows.pop()  # a trailing empty line
        if not rows:
            raise TorchCsvError("torch CSV: no rows; expected one row of actions per rank")
        self.actions: list[list[Action]] = []
        self.cells: list[list[tuple[int, str]]] = []  # (step, cell text) per action
        for rank, row in enumerate(rows):
            actions, cells = [], []
            for step, cell in enumerate(row):
                for action in _parse_cell(cell, rank, step):
                    actions.append(action)
                    cells.append((step, cell.strip()))
            self.actions.append(actions)
            self.cells.append(cells)

    def split_fused(self) -> None:
        """A schedule that splits any backward splits every one: B becomes I then W."""
        if not any(a.kind in (I, W) for row in self.actions for a in row):
            return
        for r, row in enumerate(self.actions):
            actions, cells = [], []
            for action, cell in zip(row, self.cells[r], strict=True):
                halves = [action._replace(kind=I), action._replace(kind=W)]
                parts = halves if action.kind == B else [action]
                actions += parts
                cells += [cell] * len(parts)
            self.actions[r], self.cells[r] = actions, cells


def infer_placement(rows: Sequence[Sequence[Action]], kind: str | None = None) -> Placement:
    """The placement whose stages per rank are exactly the stages each row runs (``kind``: only
    that one; else one stage per rank, then a V, then a loop: with one rank the V and the loop
    of two stages coincide)."""
    P = len(rows)
    seen = [sorted({a.stage for a in row}) for row in rows]
    S = max((s for stages in seen for s in stages), default=-1) + 1
    if kind is not None and kind not in PLACEMENTS:
        raise TorchCsvError(f"placement {kind!r} is not one of {', '.join(PLACEMENTS)}")
    if S == 0:
        raise TorchCsvError("torch CSV: no forward or backward in any row")
    for candidate in (kind,) if kind else ("one", "v", "loop"):
        if S % P or (candidate == "one" and S != P) or (candidate == "v" and S != 2 * P):
            continue
        placement = Placement(candidate, P, S // P)
        if all(list(placement.stages_of(r)) == sorted(seen[r]) for r in range(P)):
            return placement
    runs = "; ".join(f"rank {r}: {', '.join(map(str, s)) or 'nothing'}" for r, s in enumerate(seen))
    raise TorchCsvError(
        f"torch CSV: the rows' stages ({runs}) fit no placement nobubble runs: one stage per "
        f"rank (stage r on rank r), a loop (rank r holds r, r+{P}, ...) or a V (rank r holds r "
        f"and {2 * P - 1}-r)" + (f" as asked ({kind})" if kind else "")
    )


def from_torch_csv(
    text: str,
    name: str = "torch-csv",
    num_steps: int = 1,
    num_microbatches: int | None = None,
    placement: str | None = None,
) -> Schedule:
    """A nobubble Schedule from torch CSV rows: ``num_steps`` batches of the rows, each rank's
    batch followed by one STEP per stage. ``num_microbatches`` defaults to the most forwards a
    stage runs; ``placement`` to the one the rows fit. Not validated: see ``validate_torch_csv``."""
    rows = _Rows(text)
    rows.split_fused()
    where = infer_placement(rows.actions, placement)
    M = num_microbatches
    if M is None:  # every micro-batch runs one forward on every stage
        forwards = Counter(a.stage for row in rows.actions for a in row if a.kind == F)
        M = max(forwards.values(), default=0)
    if not isinstance(num_steps, int) or num_steps < 1:
        raise TorchCsvError(f"the number of steps must be an integer >= 1, got {num_steps!r}")
    if M < 1:
        raise TorchCsvError(
            f"torch CSV: M={M}; give at least one micro-batch (every micro-batch runs one "
            "forward on every stage)"
        )
    ranks = []
    for r, row in enumerate(rows.actions):
        order: list[Action] = []
        for j in range(num_steps):
            order += [Action(a.stage, a.kind, a.number + j * M) for a in row]
            order += [Action(s, STEP, j + 1) for s in where.stages_of(r)]
        ranks.append(tuple(order))
    schedule = Schedule(
        name,
        where.num_stages,
        M,
        num_steps,
        "current",
        "current",
        tuple(ranks),
        1,
        placement=where,
    )
    schedule.meta["torch_csv_cells"] = rows.cells
    return schedule


def load_torch_csv(
    path: str | Path,
    num_steps: int = 1,
    num_microbatches: int | None = None,
    placement: str | None = None,
) -> Schedule:
    """Read the torch CSV file ``path`` as ``from_torch_csv`` does, named after the file, and
    validate it (``validate_torch_csv``)."""
    path = Path(path)
    if not path.is_file():
        raise TorchCsvError(f"torch CSV file {str(path)!r} does not exist")
    schedule = from_torch_csv(
        path.read_text(), path.stem, num_steps, num_microbatches, placement=placement
    )
    validate_torch_csv(schedule)
    return schedule


def validate_torch_csv(schedule: Schedule) -> None:
    """``validate``, with a failure also named by torch's coordinates: rank, step (the cell's
    column, counting idle cells, as torch's ``_format_pipeline_order`` numbers them) and cell."""
    try:
        validate(schedule)
    except ScheduleValidationError as err:
        raise TorchCsvError(f"{torch_location(schedule, err.rank, err.position)}: {err}") from None


def torch_location(schedule: Schedule, rank: int, position: int) -> str:
    """Where position ``position`` of rank ``rank``'s order came from in the CSV."""
    cells: list[list[tuple[int, str]]] = schedule.meta.get("torch_csv_cells", [])
    if rank >= len(cells):
        return f"torch CSV: rank {rank}"
    per_batch = len(cells[rank]) + len(schedule.placement.stages_of(rank))
    batch, offset = divmod(position, per_batch)
    if batch >= schedule.num_steps:
        return f"torch CSV: rank {rank}, end of row"
    if offset >= len(cells[rank]):
        return f"torch CSV: rank {rank}, end of row (the step nobubble adds after batch {batch})"
    step, text = cells[rank][offset]
    return f"torch CSV: rank {rank}, step {step} (cell {text!r}, batch {batch})"
