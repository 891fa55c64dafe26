"""The stage worker: one stage's module, its weight versions, gradients and optimizer step.

It knows nothing about other stages or transports: the interpreter hands it inputs and ships its
outputs. Forward reads the weight version the ledger names; backward accumulates the averaged
gradient into the master parameters' ``.grad``; step applies the batch (clip, delay correction,
optimizer) and creates the next version.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from nobubble.core.ir import Schedule
from nobubble.core.ledger import StageLedger
from nobubble.engine.split_backward import WeightWork, input_backward, weight_backward
from nobubble.engine.tree import (
    BoundarySpec,
    Tree,
    call_args,
    detached,
    differentiable,
    moved,
    non_tensor_leaves,
    pack_grads,
    unpack_grads,
)
from nobubble.engine.versions import WeightVersions
from nobubble.optim import (
    DelayCorrection,
    StageOptimizer,
    clip_coefficient,
    grad_sq_norm,
    grads_finite,
    scale_grads_,
    sum_over_stages,
)

Batch = tuple[Tree, Tree]  # (inputs of stage 0, targets of the loss)
LossFn = Callable[[Any, Any], torch.Tensor]
Tie = tuple[int, str, int, str]


def tied_square(total: torch.Tensor) -> torch.Tensor:
    """The squared norm of a tied pair's summed gradient (float64), counted once globally."""
    return total.double().pow(2).sum()


@dataclass
class TieMeeting:
    """What a stage needs from the others before a step with tied parameters: every stage's
    squared gradient norm without its tied parameters, both gradients of each pair it holds a
    copy of (keyed by (stage, name)), and the squared norm of each other pair's sum (by index
    in ``ties``), which one of that pair's ranks computed."""

    squares: list[torch.Tensor]
    grads: dict[tuple[int, str], torch.Tensor]
    pair_squares: dict[int, torch.Tensor]

    @staticmethod
    def pool(shares: list[Any]) -> TieMeeting:
        """Every stage's ``share()``, all in one process (the emulator): all the gradients."""
        grads = {(s, name): g for s, share in enumerate(shares) for name, g in share[1].items()}
        return TieMeeting([share[0] for share in shares], grads, {})


def expect_device(tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``tensor``, after checking it lives on the stage's device (a cheap comparison that turns
    a forgotten ``.to(device)`` into an error naming the tensor, on any machine)."""
    if tensor.device != device:
        raise RuntimeError(f"{what} is on {tensor.device}, but the stage runs on {device}")
    return tensor


def misplaced(tree: Any, device: torch.device, path: str = "state") -> list[str]:
    """Paths of the tensors of a nested dict/list/tuple that are not on ``device``."""
    if isinstance(tree, torch.Tensor):
        return [f"{path} ({tree.device})"] if tree.device != device else []
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in misplaced(v, device, f"{path}.{k}")]
    if isinstance(tree, list | tuple):
        return [p for i, v in enumerate(tree) for p in misplaced(v, device, f"{path}[{i}]")]
    return []


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested dict/list/tuple (a batch's inputs or targets)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of a nested dict/list/tuple moved to ``device`` (checkpoint state)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


@dataclass
class Saved:
    """What a forward keeps for its backward."""

    version: int
    weights: dict[str, torch.Tensor]  # the leaves the graph was built on (see _weights)
    inputs: Tree  # stage input: the batch's on stage 0, grad-requiring leaves elsewhere
    output: Tree | None  # None in recompute mode (the graph is rebuilt at backward)
    activation_bytes: int  # autograd's saved tensors (the stage input alone when recomputing)


@dataclass
class Pending:
    """What a split backward's I leaves for its W."""

    weights: list[torch.Tensor]  # the leaves the graph was built on (see _weights)
    work: WeightWork
    held: list[torch.Tensor]  # the output and input gradients, which W must not adopt
    activation_bytes: int


def _nothing() -> contextlib.AbstractContextManager[set[int]]:
    """No dp hooks: no gradient accumulated ahead of ``accumulate_grads``."""
    return contextlib.nullcontext(set())


def accumulate_grads(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    held: Sequence[torch.Tensor | None] = (),
) -> None:
    """Add one micro-batch's weight gradients ``grads`` into ``params``' ``.grad``.

    A parameter without ``.grad`` adopts autograd's result without a copy (as autograd's own
    accumulation does), unless that tensor may be shared: a view, a storage of ``held`` (the
    incoming gradient, a transport buffer the next receive overwrites; the input gradient, which
    the transport sends or hands on), or a storage already adopted by another parameter; those
    are copied, so a later in-place accumulation never changes a tensor someone else reads.
    """
    taken = {t.untyped_storage().data_ptr() for t in held if t is not None}
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if p.grad is not None:
                p.grad.add_(g)
                continue
            ptr = g.untyped_storage().data_ptr()
            owned = not g._is_view() and ptr not in taken
            if owned and g.dtype == p.dtype and g.stride() == p.stride():
                p.grad = g
            else:
                p.grad = g.to(p.dtype).clone()
            taken.add(ptr)


class StageWorker:
    """One stage: ``module`` is stage ``ledger.stage`` of ``schedule.num_stages``.

    The module is called with its input (a tensor, or a tuple / dict of tensors: see
    ``exec.tree``); the first stage's input is the batch's, the others' the previous stage's
    output. The last stage's output goes through ``loss_fn(output, targets)``, which returns the
    scalar loss of the micro-batch.
    """

    def __init__(
        self,
        module: nn.Module,
        schedule: Schedule,
        ledger: StageLedger,
        optimizer: StageOptimizer,
        correction: DelayCorrection,
        batch_fn: Callable[[int], Batch],
        lr_fn: Callable[[int], float] | None,
        clip_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        recompute: bool = False,
        *,
        loss_fn: LossFn | None = None,
        sharded: Any = None,
    ) -> None:
        self.module, self.schedule, self.ledger = module, schedule, ledger
        self.stage, self.num_stages = ledger.stage, schedule.num_stages
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(f"stage {self.stage} is the last stage: it needs a loss_fn")
        self.loss_fn = loss_fn
        self.optimizer, self.correction = optimizer, correction
        self.batch_fn, self.lr_fn, self.clip_norm = batch_fn, lr_fn, clip_norm
        self.autocast_dtype, self.recompute = autocast_dtype, recompute
        self.named = list(module.named_parameters())
        self.master: dict[str, torch.Tensor] = dict(self.named)
        if not self.named:
            raise ValueError(
                f"stage {self.stage} has no parameters: a pipeline stage must own weights to "
                "train; move a split point so that every stage holds at least one layer"
            )
        # the stage's declared device: inputs, state and buffers must all live there
        self.device = self.named[0][1].device
        # a stage sharded over its dp group (distributed/fsdp.py's FSDPStage): its parameters
        # are DTensor shards; it gathers the weights each action reads and reduce-scatters the
        # gradients each backward makes
        self.sharded = sharded
        self.versions = self._new_versions(schedule, ledger)
        self.saved: dict[int, Saved] = {}
        self.pending: dict[int, Pending] = {}  # split backward: I ran, W not yet
        self.backwards_in_batch = 0
        # data parallelism: the GradReducer whose all-reduce the batch's last backward
        # launches (it binds itself here; None: launched where the plan puts it)
        self.reducer: Any = None
        # micro-batch -> loss (last stage only), kept as a device tensor until a drain point reads
        # it: a float() per micro-batch would stall a GPU's queue once per micro-batch
        self.losses: dict[int, torch.Tensor] = {}
        self.peak_saved = 0
        self.peak_activation_bytes = 0
        self.grad_norms: dict[int, float] = {}  # step -> gradient norm before clipping
        self.in_spec: BoundarySpec | None = None  # agreed at the first micro-batch
        self.forwards = 0  # forwards run in this schedule (they run in micro-batch order)
        # tied parameters across stages, (stage a, name a, stage b, name b) with a < b: the
        # same pipeline-wide list on every stage; the step adds the two gradients (see share)
        self.ties: list[Tie] = []
        self.out_spec: BoundarySpec | None = None

    def use_schedule(self, schedule: Schedule, ledger: StageLedger, fresh: bool) -> None:
        """Run on from here under ``schedule``: a longer horizon of the same pipeline whose
        actions so far are those already run (``fresh=False``), or, at a drain point, a new
        segment numbered from 0 again (``fresh=True``)."""
        assert ledger.stage == self.stage, (ledger.stage, self.stage)
        if fresh:
            assert not self.saved and self.backwards_in_batch == 0, "a new segment mid-batch"
            peak = self.versions.peak_live  # the most over the whole run, segments included
            self.versions = self._new_versions(schedule, ledger)
            self.versions.peak_live = peak
            self.forwards = 0
        else:
            self.versions.extend(schedule, ledger)
        self.schedule, self.ledger = schedule, ledger

    def _new_versions(self, schedule: Schedule, ledger: StageLedger) -> WeightVersions:
        if self.sharded is None:
            return WeightVersions(self.named, schedule, ledger, predict=self.correction.predicts)
        assert not self.correction.predicts, "Pipeline refuses predict with shard='fsdp'"
        return self.sharded.versions(self.named, schedule, ledger)

    def _materialized(
        self, leaves: Sequence[torch.Tensor], version: int
    ) -> contextlib.AbstractContextManager[Any]:
        """Around an action on a sharded stage: ``leaves`` hold ``version``'s whole weights."""
        if self.sharded is None:
            return contextlib.nullcontext()
        return self.sharded.materialized(self.versions, leaves, version)

    # ----- forward -------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = self.named[0][1].device.type
        return torch.autocast(device_type=device, dtype=self.autocast_dtype)

    def _to_device(self, value: Tree) -> Tree:
        return moved(value, self.device)

    def _weights(self, m: int, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The leaves micro-batch m's graph is built on, ``key`` = (version, tau) being the
        weights it reads (tau > 0: a prediction, ``exec.versions``): the master parameters
        themselves when the forward reads the current version and the stage takes no step
        before m's gradient is done (every micro-batch of a synchronous schedule), else the
        version's aliases or the prediction's own tensors (on a sharded stage always its
        leaves, filled around each action)."""
        ledger, (version, tau) = self.ledger, key
        if (
            self.sharded is None
            and tau == 0
            and version == self.versions.current
            and ledger.fwd_current[m] == version
            and ledger.applied_step[m] == version + 1
        ):
            return self.master
        return self.versions.get(key)

    def _run(
        self, weights: dict[str, torch.Tensor], inputs: Tree, m: int, record: bool = True
    ) -> Tree:
        args, kwargs = call_args(inputs)
        with self.autocast(), self._count_saved(weights):
            if weights is self.master:  # the module's own parameters: no reparametrization
                out = self.module(*args, **kwargs)
            else:
                out = functional_call(self.module, weights, args, kwargs)
            if not self.is_last:
                return out
            targets = self._to_device(self.batch_fn(m)[1])
            for t in _tensors(targets):
                expect_device(t, self.device, "targets")
            assert self.loss_fn is not None
            loss = self.loss_fn(out, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + ": reduce the loss of the micro-batch to one number (e.g. its mean)"
            )
        if record:  # the loss of the forward; a recomputing backward does not report again
            self.losses[m] = loss.detach()
        return loss / self.schedule.num_microbatches  # the batch loss is the micro-batch mean

    def _count_saved(self, weights: dict[str, torch.Tensor]) -> Any:
        """Measure the activation bytes autograd saves for backward (weights excluded).

        Unique storages are counted once; the count lands in ``self._saved_bytes``. The hook
        keeps a detached alias, never ``t`` itself: when an op saves its own output, ``t``'s
        grad_fn is the node that saves it, and that cycle (node -> saved tensor -> node) is
        broken only by a backward that frees the graph. The split backward retains the graph
        (I, then W), so every micro-batch's activations would stay alive for good.
        """
        weight_storages = {w.untyped_storage().data_ptr() for w in weights.values()}
        seen: set[int] = set()
        self._saved_bytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in weight_storages and ptr not in seen:
                seen.add(ptr)
                self._saved_bytes += storage.nbytes()
            return t.detach()

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _check_boundary(
        self, value: Tree, what: str, m: int, agreed: BoundarySpec | None
    ) -> BoundarySpec:
        """The spec of ``value``, checked against the one agreed at the first micro-batch."""
        strays = non_tensor_leaves(value)
        if strays:
            raise TypeError(
                f"stage {self.stage} {what} for micro-batch {m} holds {', '.join(strays)}: a "
                "stage boundary carries tensors only (a tensor, or a tuple or dict of tensors); "
                "recompute other values inside the next stage"
            )
        spec = BoundarySpec.of(value)
        if agreed is not None and spec != agreed:
            raise ValueError(
                f"stage {self.stage} {what} for micro-batch {m} is {spec.describe()}, but the "
                f"first micro-batch agreed on {agreed.describe()}: every micro-batch must keep "
                "the shapes and dtypes of the first (equal batch sizes, fixed sequence length)"
            )
        return spec

    def forward(self, m: int, received: Tree | None) -> Tree | None:
        """Run micro-batch m; return the activation to send on (None on the last stage)."""
        version = self.ledger.fwd_version[m]
        key = self.versions.key(m)
        weights = self._weights(m, key)
        if self.is_first:
            inputs = self._to_device(self.batch_fn(m)[0])
        else:
            assert received is not None, f"stage {self.stage} got no activation for {m}"
            inputs = detached(received, requires_grad=True)
        for t in _tensors(inputs):
            expect_device(t, self.device, f"the input of micro-batch {m}")
        self.in_spec = self._check_boundary(inputs, "input", m, self.in_spec)
        if self.recompute:  # keep only the stage input; the graph is rebuilt at backward
            with torch.no_grad(), self._materialized(list(weights.values()), version):
                out = self._run(weights, inputs, m)
            saved_out = None
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(inputs))
        else:
            with self._materialized(list(weights.values()), version):
                out = self._run(weights, inputs, m)
            saved_out, nbytes = out, self._saved_bytes
        self.saved[m] = Saved(version, weights, inputs, saved_out, nbytes)
        self._track_memory()
        self.versions.consumed(key)
        self.forwards += 1
        if self.is_last:
            return None
        self.out_spec = self._check_boundary(out, "output", m, self.out_spec)
        return detached(out, requires_grad=False)

    @torch.no_grad()
    def infer(self, inputs: Tree, targets: Tree = None) -> Tree:
        """A forward on the master weights for evaluation, outside the schedule: the stage's
        output, or on the last stage the loss of ``targets`` (nothing saved, no version read)."""
        inputs = self._to_device(inputs)
        args, kwargs = call_args(inputs)
        current = self.versions.current
        weights = self.master if self.sharded is None else self.versions.get((current, 0))
        with self.autocast(), self._materialized(list(weights.values()), current):
            if weights is self.master:
                out = self.module(*args, **kwargs)
            else:
                out = functional_call(self.module, weights, args, kwargs)
            if not self.is_last:
                return out
            assert self.loss_fn is not None
            return self.loss_fn(out, self._to_device(targets))

    def _track_memory(self) -> None:
        """Micro-batches held for backward: saved for B or I, or waiting for their W."""
        self.peak_saved = max(self.peak_saved, len(self.saved) + len(self.pending))
        held = sum(s.activation_bytes for s in self.saved.values())
        held += sum(p.activation_bytes for p in self.pending.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, held)

    # ----- backward ------------------------------------------------------------------------
    def _graph(
        self, m: int, saved: Saved, grad_out: Tree | None
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """The weights, outputs and output gradients micro-batch m's backward starts from."""
        version = self.ledger.bwd_version[m]
        if self.recompute:  # rebuild the graph with the weights current now (live weights)
            weights = self._weights(m, (version, 0))
            out = self._run(weights, saved.inputs, m, record=False)
        else:
            # Stashed rules: the forward's aliases hold the stash. Live rules: the aliases share
            # the master's storage, so the saved graph reads the weights as updated since.
            assert saved.output is not None
            weights, out = saved.weights, saved.output
        if self.is_last:
            return weights, [out], None
        assert grad_out is not None, f"stage {self.stage} got no gradient for {m}"
        grad_list = unpack_grads(grad_out)
        for g in grad_list:
            expect_device(g, self.device, f"the gradient of micro-batch {m}")
        return weights, differentiable(out), grad_list

    def backward(self, m: int, grad_out: Tree | None) -> Tree | None:
        """Backward of micro-batch m; return the gradient for the previous stage (or None)."""
        saved = self.saved.pop(m)
        with self._materialized(self._backward_leaves(m, saved), self.ledger.bwd_version[m]):
            weights, outputs, grad_outputs = self._graph(m, saved, grad_out)
            leaves = list(weights.values())
            input_leaves = [] if self.is_first else differentiable(saved.inputs)
            with self._reducing(m, leaves) as done:
                grads = torch.autograd.grad(
                    outputs,
                    input_leaves + leaves,
                    grad_outputs=grad_outputs,
                    materialize_grads=True,  # an input or weight the outputs do not use: zeros
                )
        grads_in = list(grads[: len(input_leaves)])
        held = [*(grad_outputs or []), *grads_in]
        self._accumulate(m, grads[len(input_leaves) :], held, done)
        self._backward_done(m)
        self.backwards_in_batch += 1
        return pack_grads(grads_in) if grads_in else None

    def backward_input(self, m: int, grad_out: Tree | None) -> Tree | None:
        """I, the first half of a split backward: the gradient for the previous stage (None
        on the first stage); what W needs stays in ``pending`` (``exec.split``)."""
        saved = self.saved.pop(m)
        with self._materialized(self._backward_leaves(m, saved), self.ledger.bwd_version[m]):
            weights, outputs, grad_outputs = self._graph(m, saved, grad_out)
            leaves = list(weights.values())
            input_leaves = [] if self.is_first else differentiable(saved.inputs)
            grads_in, work = input_backward(outputs, grad_outputs, input_leaves, leaves)
        held = [*(grad_outputs or []), *grads_in]  # what B's accumulation keeps apart too
        self.pending[m] = Pending(leaves, work, held, saved.activation_bytes)
        self._backward_done(m)
        return pack_grads(grads_in) if grads_in else None

    def backward_weight(self, m: int) -> None:
        """W, the second half: micro-batch m's weight gradients, accumulated as B's are."""
        pending = self.pending.pop(m)
        # one autograd call over the weight leaves (a stage without input gradient) launches
        # the dp buckets from inside as B does; W's per-group calls give a weight that several
        # groups reach only a partial gradient per call, so they launch when W returns
        whole = pending.work.whole is not None
        with (
            self._materialized(pending.weights, self.ledger.bwd_version[m]),
            self._reducing(m, pending.weights) if whole else _nothing() as done,
        ):
            grads = weight_backward(pending.work, pending.weights)
        self._accumulate(m, grads, pending.held, done)
        self.backwards_in_batch += 1

    def _backward_leaves(self, m: int, saved: Saved) -> list[torch.Tensor]:
        """The leaves micro-batch m's backward differentiates: the forward's, or in recompute
        mode those of the version it recomputes at."""
        if self.recompute:
            return list(self._weights(m, (self.ledger.bwd_version[m], 0)).values())
        return list(saved.weights.values())

    def _last_of_batch(self) -> bool:
        """Whether the backward running now (B, or W of a split backward) completes the batch."""
        return self.backwards_in_batch + 1 == self.schedule.num_microbatches

    def _reducing(
        self, m: int, leaves: Sequence[torch.Tensor]
    ) -> contextlib.AbstractContextManager[set[int]]:
        """Around the autograd call of micro-batch m's weight gradients: with data parallelism,
        the batch's last backward launches the dp all-reduce bucket by bucket from inside, as
        gradients become final (``GradReducer.launching``); it yields the parameters whose
        gradients it accumulated already."""
        if self.reducer is None or not self._last_of_batch():
            return _nothing()
        return self.reducer.launching(m // self.schedule.num_microbatches + 1, leaves)

    def _accumulate(
        self, m: int, grads: Sequence[torch.Tensor], held: Sequence[torch.Tensor], done: set[int]
    ) -> None:
        """Accumulate the weight gradients the dp hooks did not (``done``: all, or none); the
        batch's last backward then launches the buckets still waiting (weights it never
        reached)."""
        if self.sharded is not None:  # reduce-scattered into the sharded .grad right away
            self.sharded.accumulate(grads)
            return
        params = [p for _, p in self.named]
        rest = [i for i in range(len(params)) if i not in done]
        accumulate_grads([params[i] for i in rest], [grads[i] for i in rest], held)
        if self.reducer is not None and self._last_of_batch():
            self.reducer.launch_rest(m // self.schedule.num_microbatches + 1)

    def _backward_done(self, m: int) -> None:
        if self.schedule.backward_rule == "stashed":  # it read what its forward read
            self.versions.consumed(self.versions.key(m))

    def pop_losses(self, micro_batches: Iterable[int]) -> list[float]:
        """The losses of ``micro_batches`` as floats (one host sync for all of them)."""
        values = torch.stack([self.losses.pop(m) for m in micro_batches]).float().cpu()
        return values.tolist()

    @property
    def batch_complete(self) -> bool:
        return self.backwards_in_batch == self.schedule.num_microbatches

    def grad_sq_norm(self) -> torch.Tensor:
        if self.sharded is not None:  # the shards' shares, summed over the dp group
            return self.sharded.grad_sq_norm()
        return grad_sq_norm(p for _, p in self.named)

    def _grads_finite(self) -> bool:
        if self.sharded is not None:
            return bool(self.sharded.grads_finite())
        return grads_finite([p for _, p in self.named])

    def _tied_here(self) -> list[str]:
        return [n for t in self.ties for s, n in ((t[0], t[1]), (t[2], t[3])) if s == self.stage]

    def share(self) -> Any:
        """What this stage offers the others before a step that meets across stages: its
        squared gradient norm, or with tied parameters (its norm without them, their grads)."""
        if not self.ties:
            return self.grad_sq_norm()
        tied = set(self._tied_here())
        grads = {n: p.grad for n, p in self.named if n in tied}
        return grad_sq_norm(p for n, p in self.named if n not in tied), grads

    def _add_tied(self, shares: list[Any] | TieMeeting) -> torch.Tensor:
        """Give each tied parameter of this stage the sum of both copies' gradients (lower
        stage first, on every stage alike); return the global squared norm, each tied pair
        counted once. Both copies then take the same step, so they stay bitwise equal.

        ``shares``: every stage's ``share()`` in stage order (the emulator), or the meeting a
        rank of the runtime pooled (its pairs' gradients, the other pairs' squares)."""
        meeting = shares if isinstance(shares, TieMeeting) else TieMeeting.pool(shares)
        params = dict(self.named)
        pairs = []
        for k, (a, name_a, b, name_b) in enumerate(self.ties):
            if k in meeting.pair_squares:  # a pair of two other ranks: its square came along
                pairs.append(meeting.pair_squares[k])
                continue
            total = meeting.grads[a, name_a] + meeting.grads[b, name_b]
            pairs.append(tied_square(total))
            for stage, name in ((a, name_a), (b, name_b)):
                if stage == self.stage:
                    params[name].grad = total.clone()
        squares = sum_over_stages(meeting.squares)
        for square in pairs:
            squares = squares + square.to(squares.device)
        return squares

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything this stage needs to continue from a drain point. ``copy=False``: the
        module's own tensors instead of copies (a checkpoint written at once, without a
        second copy of the weights)."""
        assert not self.saved and self.backwards_in_batch == 0, "checkpoint only at a drain point"
        module = {k: v.detach() for k, v in self.module.state_dict().items()}
        state = {
            "stage": self.stage,
            "module": {k: v.clone() for k, v in module.items()} if copy else module,
            "optimizer": self.optimizer.state_dict(),
            "correction": self.correction.state_dict(),
            "versions": self.versions.state_dict(),
            "peak_saved": self.peak_saved,
            "peak_activation_bytes": self.peak_activation_bytes,
        }
        if self.sharded is not None:  # whole tensors: a dp collective, on every replica
            state = self.sharded.gathered(state)
        return state

    def module_state(self) -> dict[str, torch.Tensor]:
        """A copy of the stage module's state dict, whole (a dp collective when sharded)."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        return state if self.sharded is None else self.sharded.gathered(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage"] != self.stage:
            raise ValueError(
                f"checkpoint part of stage {state['stage']} given to stage {self.stage}"
            )
        state = to_device(state, self.device)  # EF buffers and stashed versions included
        if self.sharded is not None:  # this replica's shards of the whole tensors
            state = self.sharded.scattered(state, self.optimizer)
        with torch.no_grad():
            for name, p in self.named:
                p.copy_(state["module"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.correction.load_state_dict(state["correction"])
        stashed = self.schedule.backward_rule == "stashed"
        first = state["versions"]["current"] * self.schedule.num_microbatches
        self.versions.load_state_dict(state["versions"], self.ledger, stashed, first)
        self.peak_saved = state["peak_saved"]
        self.peak_activation_bytes = state["peak_activation_bytes"]

    # ----- step ----------------------------------------------------------------------------
    def lr_of(self, step: int) -> float:
        """The learning rate step ``step`` (1-based) applies."""
        return self.optimizer.lr if self.lr_fn is None else self.lr_fn(step - 1)

    def step(self, step: int, total_sq_norm: Any = None) -> None:
        """Apply batch ``step - 1``: lr, clipping, correction and optimizer, new version.

        ``total_sq_norm``: the global squared gradient norm (global clipping), or, with tied
        parameters, every stage's ``share()`` in stage order; None: this stage's own norm.
        """
        assert self.batch_complete, f"stage {self.stage}: step {step} before its batch finished"
        if self.ties:
            assert isinstance(total_sq_norm, list | TieMeeting), "tied parameters need the meeting"
            total_sq_norm = self._add_tied(total_sq_norm)
        params: list[torch.Tensor] = [p for _, p in self.named]
        norm = math.sqrt(float(self.grad_sq_norm() if total_sq_norm is None else total_sq_norm))
        # A non-finite entry makes the norm non-finite, so the norm (read anyway) screens every
        # step for free; only a non-finite norm pays the exact pass, which tells a non-finite
        # gradient of this stage from an overflowing square or another stage's.
        if not math.isfinite(norm) and not self._grads_finite():
            raise FloatingPointError(
                f"stage {self.stage}, step {step}: non-finite gradients; lower --lr, enable "
                "clipping (--clip 1.0) or train in fp32 (--dtype fp32)"
            )
        self.grad_norms[step] = norm
        if self.clip_norm is not None:
            scale_grads_(params, clip_coefficient(norm, self.clip_norm))
        delay = self.batch_delay(step)
        factor = self.correction.lr_factor(step - 1, delay)
        if self.lr_fn is not None:
            self.optimizer.set_lr(self.lr_fn(step - 1) * factor)
        elif self.correction.scales_lr:  # a user's optimizer (lr_fn None): scale its own lr
            self.optimizer.set_lr(factor)
        # prediction: the weights before the update, from which the new version's predictions
        # are extrapolated (a transient copy, only when the ledger says they will be read)
        due = self.versions.predictions_due()
        previous = [p.detach().clone() for p in params] if due else None
        self.versions.before_update()
        self.correction.apply(params, self.optimizer.step, delay)
        self.optimizer.zero_grad(set_to_none=True)
        self.versions.after_update(previous)
        self.backwards_in_batch = 0

    def batch_delay(self, step: int) -> float:
        """The stage's delay at step ``step``: the mean, over the micro-batches of the batch it
        applies, of the versions between the one each forward read and the one its gradient
        is applied to (the ledger's ``delay``; 1 for 2BW, the crossed share for PACI)."""
        m = self.schedule.num_microbatches
        delays = self.ledger.delay[(step - 1) * m : step * m]
        return sum(delays) / len(delays)
