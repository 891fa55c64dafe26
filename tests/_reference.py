"""Independent reference training loops for the emulator's oracle tests.

Nothing here imports nobubble.engine: each loop is plain PyTorch on the unsplit model or on plain
per-stage modules, written from the semantics of docs/semantics.md (and the papers), so that a
bug in the worker, the weight versions or the interpreter cannot hide in both sides. The model,
the optimizer factory, the schedules, the ledger and the simulator are used as given: they are
not the code under test here and have their own tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from nobubble.core.ir import STEP, Action, B, F, Schedule
from nobubble.core.ledger import Ledger
from nobubble.core.sim import CostModel, simulate
from nobubble.model import ModelConfig, build_model, split_model
from nobubble.optim import OptimConfig, build_optimizer, lr_at

CFG = ModelConfig(
    vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=16
)
SEED = 0
BATCH_SIZE = 2  # sequences per micro-batch


def batch_fn(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch m (global index): inputs and next-token targets, each (BATCH_SIZE, T)."""
    gen = torch.Generator().manual_seed(1000 + m)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH_SIZE, CFG.max_seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def optim_config(name: str) -> OptimConfig:
    """Weight decay on (the default 0.1) so that decaying the current weights is exercised."""
    return OptimConfig(name=name, lr=1e-2, clip_norm=None, warmup_frac=0.0)


@dataclass
class RefResult:
    losses: list[float]  # per micro-batch, global index
    params: dict[str, torch.Tensor]  # full-model names
    grad_norms: list[float]  # per step, before clipping (0.0 when not computed)


def _params_of(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        out.update({n: p.detach().clone() for n, p in module.named_parameters()})
    return out


# ----- whole-model loops ---------------------------------------------------------------------
def plain_accumulation(
    optimizer: str, num_microbatches: int, num_steps: int, clip_norm: float | None = None
) -> RefResult:
    """Non-pipelined gradient accumulation: step j applies the mean gradient of batch j at x[j]."""
    ocfg = optim_config(optimizer)
    model = build_model(CFG, SEED)
    opt = build_optimizer(ocfg, list(model.named_parameters()))
    losses, norms = [], []
    for j in range(num_steps):
        for i in range(num_microbatches):
            x, y = batch_fn(j * num_microbatches + i)
            loss = model(x, y)
            (loss / num_microbatches).backward()
            losses.append(loss.item())
        if clip_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)))
        opt.set_lr(lr_at(j, num_steps, ocfg))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return RefResult(losses, _params_of([model]), norms)


def _written_out_error_feedback(
    params: list[nn.Parameter],
    before: list[torch.Tensor],
    prev: list[torch.Tensor] | None,
    step: int,
    lam: float,
) -> list[torch.Tensor]:
    """x_{t+1} = x_t + d_t + lam (d_t - d_{t-1}) from step 3 on; returns the raw d_t."""
    with torch.no_grad():
        displacement = [p - b for p, b in zip(params, before, strict=True)]  # d_t, raw
        if step >= 3:
            assert prev is not None
            for p, d, d_prev in zip(params, displacement, prev, strict=True):
                p.add_(lam * (d - d_prev))
    return displacement


def delayed_gradient(
    optimizer: str, num_microbatches: int, num_steps: int, ef_lam: float | None = None
) -> RefResult:
    """x[j+1] = x[j] - u(g_j(x[j-1])): batch j's gradient taken on a copy of the weights of one
    step earlier (batches 0 and 1 both at x[0]), handed to the optimizer of the current weights
    (weight decay and optimizer state see x[j] and the stale gradient). With ``ef_lam`` the
    update-level error feedback, written out, follows every optimizer step."""
    ocfg = optim_config(optimizer)
    model = build_model(CFG, SEED)
    opt = build_optimizer(ocfg, list(model.named_parameters()))
    params = list(model.parameters())
    stale = copy.deepcopy(model)  # x[max(j-1, 0)]
    losses: list[float] = []
    prev: list[torch.Tensor] | None = None
    for j in range(num_steps):
        for i in range(num_microbatches):
            x, y = batch_fn(j * num_microbatches + i)
            loss = stale(x, y)
            (loss / num_microbatches).backward()
            losses.append(loss.item())
        read_next = copy.deepcopy(model)  # x[j], what batch j+1 reads
        for p, q in zip(params, stale.parameters(), strict=True):
            p.grad = q.grad  # the stale gradient, applied to the current weights
        opt.set_lr(lr_at(j, num_steps, ocfg))
        before = [p.detach().clone() for p in params]
        opt.step()
        if ef_lam is not None:
            prev = _written_out_error_feedback(params, before, prev, j + 1, ef_lam)
        opt.zero_grad(set_to_none=True)
        stale = read_next
    return RefResult(losses, _params_of([model]), [])


# ----- ledger-driven per-stage loops ---------------------------------------------------------
def global_order(schedule: Schedule) -> list[Action]:
    """A valid global execution order: the simulator's actions of all ranks by (start, rank).

    The sort is stable, so a zero-length STEP keeps its place in its rank's order.
    """
    timeline = simulate(schedule, CostModel()).timeline
    spans = [
        (start, rank, a)
        for rank in range(schedule.num_ranks)
        for a, start, _ in timeline.spans(rank)
    ]
    spans.sort(key=lambda item: (item[0], item[1]))
    return [a for _, _, a in spans]


class _StageLoop:
    """Shared bookkeeping of the per-stage loops: modules, optimizers, messages, losses."""

    def __init__(self, schedule: Schedule, ledger: Ledger, optimizer: str) -> None:
        self.schedule, self.ledger = schedule, ledger
        self.ocfg = optim_config(optimizer)
        self.stages = split_model(build_model(CFG, SEED), schedule.num_stages)
        self.opts = [build_optimizer(self.ocfg, list(s.named_parameters())) for s in self.stages]
        self.steps = [0] * schedule.num_stages  # optimizer steps each stage has taken
        self.acts: dict[tuple[int, int], torch.Tensor] = {}  # (consumer stage, m) -> activation
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # (consumer stage, m) -> grad
        self.losses: dict[int, float] = {}

    def stage_input(self, s: int, m: int) -> torch.Tensor:
        if s == 0:
            return batch_fn(m)[0]
        return self.acts.pop((s, m)).detach().requires_grad_(True)

    def run_stage(
        self, module: nn.Module, s: int, m: int, inputs: torch.Tensor, record: bool = True
    ) -> torch.Tensor:
        """Stage forward; the last stage returns its loss divided by M (the batch mean) and
        records the loss of its forward (``record``)."""
        if s < self.schedule.num_stages - 1:
            return module(inputs)
        loss = module(inputs, batch_fn(m)[1])
        if record:
            self.losses[m] = loss.item()
        return loss / self.schedule.num_microbatches

    def send_forward(self, s: int, m: int, out: torch.Tensor) -> None:
        if s < self.schedule.num_stages - 1:
            self.acts[(s + 1, m)] = out.detach()

    def grad_output(self, s: int, m: int) -> torch.Tensor | None:
        return None if s == self.schedule.num_stages - 1 else self.grads.pop((s, m))

    def send_backward(self, s: int, m: int, inputs: torch.Tensor) -> None:
        if s > 0:
            assert inputs.grad is not None
            self.grads[(s - 1, m)] = inputs.grad

    def step(self, s: int, number: int) -> None:
        assert number == self.steps[s] + 1, f"stage {s}: step {number} after {self.steps[s]}"
        opt = self.opts[s]
        opt.set_lr(lr_at(number - 1, self.schedule.num_steps, self.ocfg))
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps[s] += 1

    def run(self) -> RefResult:
        for action in global_order(self.schedule):
            {F: self.forward, B: self.backward, STEP: self.on_step}[action.kind](
                action.stage, action.number
            )
        total = self.schedule.total_microbatches
        assert not self.acts and not self.grads, "messages left undelivered"
        return RefResult([self.losses[m] for m in range(total)], _params_of(self.stages), [])

    def forward(self, s: int, m: int) -> None:
        raise NotImplementedError

    def backward(self, s: int, m: int) -> None:
        raise NotImplementedError

    def on_step(self, s: int, number: int) -> None:
        raise NotImplementedError


class StashedWeightsLoop(_StageLoop):
    """PipeDream: every version of a stage is kept as a deep copy; F and B of a micro-batch run
    on the copy current at F; B adds the copy's gradient into the master's accumulator."""

    def __init__(self, schedule: Schedule, ledger: Ledger, optimizer: str = "adamw") -> None:
        super().__init__(schedule, ledger, optimizer)
        self.copies = [[copy.deepcopy(master)] for master in self.stages]  # [s][version]
        self.saved: dict[tuple[int, int], tuple[int, nn.Module, torch.Tensor, torch.Tensor]] = {}
        self.versions_used: dict[tuple[int, int], int] = {}

    def forward(self, s: int, m: int) -> None:
        version = self.steps[s]  # the current version: the newest copy
        assert self.ledger.stages[s].fwd_version[m] == version, (s, m, version)
        module = self.copies[s][version]
        inputs = self.stage_input(s, m)
        out = self.run_stage(module, s, m, inputs)
        self.saved[(s, m)] = (version, module, inputs, out)
        self.versions_used[(s, m)] = version
        self.send_forward(s, m, out)

    def backward(self, s: int, m: int) -> None:
        version, module, inputs, out = self.saved.pop((s, m))
        assert self.ledger.stages[s].bwd_version[m] == version, (s, m, version)
        out.backward(self.grad_output(s, m))
        with torch.no_grad():
            for p, q in zip(self.stages[s].parameters(), module.parameters(), strict=True):
                assert q.grad is not None
                p.grad = q.grad if p.grad is None else p.grad + q.grad
                q.grad = None  # the copy may serve other in-flight micro-batches
        self.send_backward(s, m, inputs)

    def on_step(self, s: int, number: int) -> None:
        self.step(s, number)
        self.copies[s].append(copy.deepcopy(self.stages[s]))


def _unsafe_restore_versions(params: list[nn.Parameter], counters: list[int]) -> None:
    """The "patched PyTorch" route of arXiv 2606.07881: hide an in-place update from autograd."""
    torch._C._autograd._unsafe_set_version_counter(tuple(params), tuple(counters))


class LiveWeightsLoop(_StageLoop):
    """PACI: F runs the master stage module itself and keeps the graph; STEP updates the master
    in place and restores the autograd version counters; B backprops the saved graph, which
    reads the weights as they are now. With ``recompute``, F keeps only the stage input and B
    reruns the stage forward on the live weights before backpropagating."""

    def __init__(
        self, schedule: Schedule, ledger: Ledger, optimizer: str = "adamw", recompute: bool = False
    ) -> None:
        super().__init__(schedule, ledger, optimizer)
        self.recompute = recompute
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.bwd_steps: dict[tuple[int, int], int] = {}

    def forward(self, s: int, m: int) -> None:
        assert self.ledger.stages[s].fwd_version[m] == self.steps[s], (s, m, self.steps[s])
        inputs = self.stage_input(s, m)
        if self.recompute:
            with torch.no_grad():
                out = self.run_stage(self.stages[s], s, m, inputs)
            self.saved[(s, m)] = (inputs, None)
        else:
            out = self.run_stage(self.stages[s], s, m, inputs)
            self.saved[(s, m)] = (inputs, out)
        self.send_forward(s, m, out)

    def backward(self, s: int, m: int) -> None:
        inputs, out = self.saved.pop((s, m))
        assert self.ledger.stages[s].bwd_version[m] == self.steps[s], (s, m, self.steps[s])
        self.bwd_steps[(s, m)] = self.steps[s]
        if out is None:  # recompute on the live weights
            out = self.run_stage(self.stages[s], s, m, inputs, record=False)
        out.backward(self.grad_output(s, m))  # accumulates into the master's .grad
        self.send_backward(s, m, inputs)

    def on_step(self, s: int, number: int) -> None:
        params = list(self.stages[s].parameters())
        counters = [p._version for p in params]
        self.step(s, number)
        _unsafe_restore_versions(params, counters)


# ----- delay corrections (issue 34), written out from docs/semantics.md ----------------------
def batch_delay(ledger: Ledger, s: int, number: int, num_microbatches: int) -> float:
    """Stage s's delay at step ``number``: the mean ledger delay of the batch it applies."""
    delays = ledger.stages[s].delay[(number - 1) * num_microbatches : number * num_microbatches]
    return sum(delays) / len(delays)


class CorrectedLoop(_StageLoop):
    """PipeDream, 2BW and PACI under a correction, every version kept as a deep copy.

    Stashed schedules run F and B of a micro-batch on the copy of its version; PACI
    (``live``) runs them on the master module itself, whose in-place steps hide from autograd
    as in LiveWeightsLoop, so a crossed backward reads the updated weights.
    - ``predict``: a micro-batch whose forward reads version v >= 1 and whose gradient is
      applied tau = ledger delay > 0 versions later runs F and B on a copy holding
      w_v + tau * (w_v - w_{v-1}), under every schedule;
    - ``ef_lam``: after each step, x += lam * tau * (d_t - d_{t-1}) from the third step on, d the
      raw displacement, tau the stage's mean delay over the batch the step applies;
    - ``delay_lr``: step k's lr times (1 + tau) ** -(1 - k / delay_lr) while k < delay_lr.
    """

    def __init__(
        self,
        schedule: Schedule,
        ledger: Ledger,
        optimizer: str = "adamw",
        *,
        predict: bool = False,
        ef_lam: float | None = None,
        delay_lr: int | None = None,
    ) -> None:
        super().__init__(schedule, ledger, optimizer)
        self.predict, self.ef_lam, self.delay_lr = predict, ef_lam, delay_lr
        self.live = schedule.backward_rule == "current"
        self.copies = [[copy.deepcopy(master)] for master in self.stages]  # [s][version]
        self.saved: dict[tuple[int, int], tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}
        self.prev: list[list[torch.Tensor] | None] = [None] * schedule.num_stages
        self.predicted = 0  # micro-batches that ran on a prediction

    def _module(self, s: int, m: int) -> nn.Module:
        ledger = self.ledger.stages[s]
        v, tau = ledger.fwd_version[m], ledger.delay[m]
        if not (self.predict and v >= 1 and tau > 0):
            return self.stages[s] if self.live else self.copies[s][v]
        module = copy.deepcopy(self.copies[s][v])
        with torch.no_grad():
            for p, w, w_prev in zip(
                module.parameters(),
                self.copies[s][v].parameters(),
                self.copies[s][v - 1].parameters(),
                strict=True,
            ):
                p.copy_(torch.add(w, w - w_prev, alpha=tau))
        self.predicted += 1
        return module

    def forward(self, s: int, m: int) -> None:
        module = self._module(s, m)
        inputs = self.stage_input(s, m)
        out = self.run_stage(module, s, m, inputs)
        self.saved[(s, m)] = (module, inputs, out)
        self.send_forward(s, m, out)

    def backward(self, s: int, m: int) -> None:
        module, inputs, out = self.saved.pop((s, m))
        out.backward(self.grad_output(s, m))
        with torch.no_grad():
            for p, q in zip(self.stages[s].parameters(), module.parameters(), strict=True):
                if q is p:  # the master itself: the gradient is in place already
                    continue
                assert q.grad is not None
                p.grad = q.grad if p.grad is None else p.grad + q.grad
                q.grad = None
        self.send_backward(s, m, inputs)

    def on_step(self, s: int, number: int) -> None:
        assert number == self.steps[s] + 1
        params = list(self.stages[s].parameters())
        counters = [p._version for p in params]
        self._corrected_step(s, number)
        if self.live:
            _unsafe_restore_versions(params, counters)
        self.copies[s].append(copy.deepcopy(self.stages[s]))

    def _corrected_step(self, s: int, number: int) -> None:
        tau = batch_delay(self.ledger, s, number, self.schedule.num_microbatches)
        opt, params = self.opts[s], list(self.stages[s].parameters())
        lr = lr_at(number - 1, self.schedule.num_steps, self.ocfg)
        if self.delay_lr is not None:
            exponent = max(0.0, 1.0 - (number - 1) / self.delay_lr)
            lr *= (1.0 + tau) ** -exponent
        opt.set_lr(lr)
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if self.ef_lam is not None:
            with torch.no_grad():
                d = [p - b for p, b in zip(params, before, strict=True)]
                if number >= 3 and tau != 0:
                    prev = self.prev[s]
                    assert prev is not None
                    for p, d_t, d_prev in zip(params, d, prev, strict=True):
                        p.add_(d_t - d_prev, alpha=self.ef_lam * tau)
                self.prev[s] = d
        self.steps[s] += 1
