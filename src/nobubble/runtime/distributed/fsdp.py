"""Sharded data parallelism inside a stage (``shard="fsdp"``): FSDP2 over the stage's dp group.

With ``data_parallel=D`` and ``shard="fsdp"``, torch's FSDP2 (``fully_shard``, on the "dp"
dimension of the (dp, pp) DeviceMesh) shards each stage across its D replicas: every parameter
becomes a DTensor whose local tensor holds rows r·c .. min((r+1)·c, n) of dim 0 on dp rank r
(c = ceil(n / D), FSDP2's layout), so the master weights, their gradients (``.grad``, DTensors
of the same layout) and the optimizer's state (torch's optimizers keep it like the parameter)
take 1/D of the stage's memory on each replica.

FSDP2's own runtime gathers the *current* shards into the module's parameters before a forward
and reduce-scatters what ``.backward()`` accumulated into them. A nobubble forward reads the
weight version the schedule's ledger names (PipeDream's and 2BW's stashes; the current weights
that PACI's backward reads live) through ``functional_call`` on leaves of its own, and its
backward differentiates those leaves with ``torch.autograd.grad``. So FSDP2's hooks sit on a
shell around the stage that is never called, and this module gathers and reduces over the
shards FSDP2 made, with the same two collectives (all-gather, reduce-scatter; one each per
action and dtype, over flat buffers as FSDP2's: ``shard_comm.py``):

- ``ShardedVersions``: a version is a list of local shards. The current one is the DTensor
  parameters' own local tensors, updated in place by the optimizer (FSDP2's storage never
  moves); a version a later action still reads is stashed as a copy of the local shards before
  the update: 1/D of the stage per stash. Each version also has full-shape leaves whose storage
  is empty between actions.
- ``FSDPStage.materialized``: around each F, B, I or W the leaves are filled by an all-gather
  of the shards of the version the action reads, and emptied afterwards (FSDP2's reshard after
  forward and after backward). A graph saved at F reads its leaves again at B, refilled with
  the forward's version under the stashed rules (pipedream, 2bw) and with the current weights
  under PACI's live rule.
- ``FSDPStage.accumulate``: each backward's weight gradients are reduce-scattered (SUM, then
  divided by D, as the replicated all-reduce does) into the sharded ``.grad`` right away, so
  no full gradient outlives its backward.
- Checkpoints are gathered per stage (``gathered``, a dp collective) into the replicated
  format, and cut again on load (``scattered``): a sharded run resumes at any D, sharded or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from nobubble.core.ir import Schedule
from nobubble.core.ledger import StageLedger
from nobubble.engine.versions import WeightVersions
from nobubble.runtime.distributed.shard_comm import DpGroup, Rows

SHARDS = ("none", "fsdp")


class _Shell(nn.Module):
    """What ``fully_shard`` is applied to: FSDP2 puts its forward hooks (which gather the
    current shards into the module's parameters) on the module it is given, and the worker
    calls the stage itself with the weights of the version it reads, so the hooks go here."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a sharded stage runs through its StageWorker, not FSDP's forward")


class ShardedVersions(WeightVersions):
    """``WeightVersions`` of a sharded stage: a version is a list of local shards (the current
    one: the parameters' own), and ``get`` gives full-shape leaves, empty between actions."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        schedule: Schedule,
        ledger: StageLedger,
        layouts: Sequence[Rows],
        rank: int,
    ) -> None:
        self.layouts, self.rank = list(layouts), rank
        self.stash: dict[int, list[torch.Tensor]] = {}  # version -> local shards (not current)
        super().__init__(named, schedule, ledger)

    def _aliases(self) -> dict[str, torch.Tensor]:
        leaves = {}
        for name, p in self.named:
            leaf = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            leaf.untyped_storage().resize_(0)  # filled only while an action runs on it
            leaves[name] = leaf.requires_grad_(p.requires_grad)
        return leaves

    def master_shards(self) -> list[torch.Tensor]:
        return [_local(p).detach() for _, p in self.named]

    def shards(self, version: int) -> list[torch.Tensor]:
        if version == self.current:
            return self.master_shards()
        assert version in self.stash, f"version {version} is not stashed ({sorted(self.stash)})"
        return self.stash[version]

    def consumed(self, key: tuple[int, int]) -> None:
        super().consumed(key)
        if key not in self.live:
            self.stash.pop(key[0], None)

    def before_update(self) -> None:
        """The optimizer updates the shards in place (FSDP2 gathers from that storage): a
        version still read afterwards is copied first, 1/D of the stage."""
        if self.reads_left[(self.current, 0)] > 0:
            self.stash[self.current] = [s.clone() for s in self.master_shards()]
        else:
            del self.live[(self.current, 0)]

    def state_dict(self) -> dict[str, object]:
        """The stashes as DTensors like their parameters (``FSDPStage.gathered`` makes them
        whole)."""
        stash = {
            v: {name: _like(shard, p) for (name, p), shard in zip(self.named, shards, strict=True)}
            for v, shards in self.stash.items()
        }
        return {"current": self.current, "stash": stash, "predicted": {}}

    def load_state_dict(
        self, state: dict[str, object], ledger: StageLedger, stashed: bool, first_microbatch: int
    ) -> None:
        current, stash = state["current"], state["stash"]
        assert isinstance(current, int) and isinstance(stash, dict)
        self.current, self.live, self.stash = current, {(current, 0): self._aliases()}, {}
        for v, weights in stash.items():
            self.live[(int(v), 0)] = self._aliases()
            self.stash[int(v)] = [weights[name].to_local().clone() for name, _ in self.named]
        self.forget_before(first_microbatch, ledger, stashed)
        self.ledger = ledger


def _local(t: Any) -> torch.Tensor:
    """This rank's part of a DTensor (a parameter, its ``.grad``, a piece of state)."""
    return t.to_local()


def _like(local: torch.Tensor, p: Any) -> DTensor:
    """``local`` as this rank's part of a DTensor laid out like parameter ``p``."""
    return DTensor.from_local(
        local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
    )


def _walk(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    """``tree`` (nested dicts, lists, tuples) with ``leaf`` applied to every other value."""
    if isinstance(tree, dict):
        return {k: _walk(v, leaf) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_walk(v, leaf) for v in tree)
    return leaf(tree)


class FSDPStage:
    """One replica's side of a stage sharded over its dp group: what ``StageWorker`` calls
    where a replicated stage uses its parameters directly (``StageWorker(sharded=...)``)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], dp: DpGroup) -> None:
        self.named, self.dp = named, dp
        self.layouts = [Rows(p.shape, dp.size) for _, p in named]
        for (name, p), rows in zip(named, self.layouts, strict=True):
            start, stop = rows.span(dp.rank)
            if not isinstance(p, DTensor) or p.to_local().shape[0] != stop - start:
                raise RuntimeError(f"{name} is not laid out as FSDP2's Shard(0): {p!r}")

    def versions(
        self, named: list[tuple[str, nn.Parameter]], schedule: Schedule, ledger: StageLedger
    ) -> ShardedVersions:
        return ShardedVersions(named, schedule, ledger, self.layouts, self.dp.rank)

    @contextlib.contextmanager
    def materialized(
        self, versions: ShardedVersions, leaves: Sequence[torch.Tensor], version: int
    ) -> Iterator[None]:
        """The leaves hold ``version``'s whole weights inside the block, nothing outside it.
        Written through ``.data`` (a version counter of its own), so a graph that saved them
        at forward does not see an in-place change."""
        for leaf in leaves:
            leaf.untyped_storage().resize_(leaf.numel() * leaf.element_size())
        try:
            with torch.no_grad():
                self.dp.gather(versions.shards(version), self.layouts, [x.data for x in leaves])
            yield
        finally:
            for leaf in leaves:
                leaf.untyped_storage().resize_(0)

    @torch.no_grad()
    def accumulate(self, grads: Sequence[torch.Tensor]) -> None:
        """Add one backward's whole weight gradients, averaged over the dp group, into this
        rank's rows of the parameters' sharded ``.grad``."""
        means = self.dp.reduce_scatter_mean(grads, self.layouts)
        for (_, p), mean in zip(self.named, means, strict=True):
            mean = mean.to(p.dtype)
            if p.grad is None:
                p.grad = _like(mean, p)
            else:
                _local(p.grad).add_(mean)

    def grad_sq_norm(self) -> torch.Tensor:
        """The stage's squared gradient norm (float64): the shards' shares, summed over the
        dp group in rank order."""
        grads = [_local(p.grad) for _, p in self.named if p.grad is not None]
        share = torch.zeros((), dtype=torch.float32)
        if grads:
            squares = [torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads]
            share = torch.stack(squares).sum()
        return self.dp.sum(share, "gradient-norm gather")

    def grads_finite(self) -> bool:
        grads = [_local(p.grad) for _, p in self.named if p.grad is not None]
        bad = sum(int((~torch.isfinite(g)).sum()) for g in grads)
        return float(self.dp.sum(torch.tensor(float(bad)), "non-finite count")) == 0

    # ----- checkpoints: gathered per stage, the replicated format ------------------------------
    def gathered(self, state: Any) -> Any:
        """``state`` with every DTensor made whole (one all-gather per dtype; a dp collective:
        every replica calls it with the same structure)."""
        found: list[DTensor] = []
        _walk(state, lambda v: found.append(v) if isinstance(v, DTensor) else None)
        shards = [t.to_local().detach() for t in found]
        whole = [
            torch.empty(t.shape, dtype=t.dtype, device=s.device)
            for t, s in zip(found, shards, strict=True)
        ]
        self.dp.gather(shards, [Rows(t.shape, self.dp.size) for t in found], whole, "checkpoint")
        by_id = {id(t): w for t, w in zip(found, whole, strict=True)}
        return _walk(state, lambda v: by_id[id(v)] if isinstance(v, DTensor) else v)

    def scattered(
        self, state: dict[str, Any], optimizer: Any, buffers: Sequence[str] = ()
    ) -> dict[str, Any]:
        """A stage part in the replicated format (whole tensors) cut to this rank's shards,
        as DTensors like the parameters they belong to."""
        params = dict(self.named)

        def cut(full: Any, p: Any) -> Any:
            if not isinstance(full, torch.Tensor) or full.dim() == 0 or full.shape != p.shape:
                return full
            return _like(Rows(p.shape, self.dp.size).local(full, self.dp.rank).clone(), p)

        state = dict(state)
        state["module"] = {
            k: cut(v, params[k]) if k in params else v for k, v in state["module"].items()
        }
        state["versions"] = dict(state["versions"])
        state["versions"]["stash"] = {
            v: {k: cut(t, params[k]) for k, t in weights.items()}
            for v, weights in state["versions"]["stash"].items()
        }
        correction_state = dict(state["correction"])
        for key in buffers:  # the correction's per-parameter buffers (``parameter_buffers``)
            if correction_state.get(key) is not None:
                correction_state[key] = [
                    cut(t, p) for t, (_, p) in zip(correction_state[key], self.named, strict=True)
                ]
        state["correction"] = correction_state
        state["optimizer"] = _scatter_optimizer(state["optimizer"], optimizer, cut)
        return state


def _scatter_optimizer(state: dict[str, Any], optimizer: Any, cut: Callable) -> dict[str, Any]:
    """An optimizer's state (a ``StageOptimizer``'s parts, or a user's torch optimizer) with
    each parameter-shaped tensor cut like its parameter (torch numbers the parameters of a
    state dict in the order of its param groups)."""

    def one(torch_state: dict[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
        params = [p for group in opt.param_groups for p in group["params"]]
        per_param = {
            i: {k: cut(v, params[int(i)]) for k, v in s.items()}
            for i, s in torch_state["state"].items()
        }
        return {**torch_state, "state": per_param}

    state = dict(state)
    if "parts" in state:
        state["parts"] = {k: one(v, optimizer.parts[k]) for k, v in state["parts"].items()}
    else:
        state["state"] = one(state["state"], optimizer.optimizer)
    return state


def check_ties(ties: Sequence[Any]) -> None:
    """Refuse tied parameters before any work: FSDP2 does not add their gradients."""
    if ties:
        a, name_a, b, name_b = ties[0]
        raise ValueError(
            f"{name_b} of stage {b} is tied to {name_a} of stage {a}: shard='fsdp' does not "
            "add tied gradients across sharded stages; split with untie=True "
            "(--untie-embeddings), or use shard='none'"
        )


def shard_stage(module: nn.Module, mesh: Any, timeout_s: float, stage: int) -> FSDPStage:
    """Shard ``module`` (this rank's stage) over its dp group with FSDP2; from here on its
    parameters are DTensors: build the optimizer over them afterwards."""
    scalars = [name for name, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"stage {stage}'s parameter {scalars[0]!r} is a scalar: FSDP2 shards dim 0; make "
            "it a 1-element tensor, or use shard='none'"
        )
    dp_mesh = mesh.device_mesh["dp"]
    fully_shard(_Shell(module), mesh=dp_mesh)
    return FSDPStage(list(module.named_parameters()), DpGroup(dp_mesh, timeout_s, stage))


def shard_optimizer(fsdp: FSDPStage, optimizer: Any) -> Any:
    """A named optimizer over the sharded parameters: Muon's part replaced by ``ShardedMuon``
    (Newton-Schulz on the gathered matrix); the elementwise ones run on the shards as built."""
    from nobubble.runtime.distributed.sharded_muon import ShardedMuon

    parts = getattr(optimizer, "parts", {})
    if "muon" in parts:
        parts["muon"] = ShardedMuon(parts["muon"], fsdp.dp)
    return optimizer


__all__ = [
    "SHARDS",
    "FSDPStage",
    "ShardedVersions",
    "check_ties",
    "shard_optimizer",
    "shard_stage",
]
