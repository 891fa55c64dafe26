"""PACI with ``--paci-recompute`` against a reference written from its definition.

Definition (arXiv 2606.07881 with the recompute route of docs/numerics.md, `--paci-recompute`):
micro-batch m of batch j runs forward on stage s at the weights stage s holds then (version
``fwd_version``, which may be older than j by up to ceil((P-1-s)/a): the micro-batch crosses
updates) and keeps only the stage
input. Its backward on stage s rebuilds the stage forward from that saved input at the weights
stage s holds at backward time (version j, the synchronous version) and back-propagates the
gradient that stage s+1 sent. Stage s steps once the M backwards of batch j are done.

The reference below is plain PyTorch on the unsplit model: one batch at a time, each micro-batch
forward through every stage at the version the ledger names, then backward from the last stage
to the first at version j, then one optimizer step per stage. It keeps every weight version as
a snapshot, so it needs no schedule order, no worker, no weight aliases and no transport; only
the model, the optimizer factory and the ledger's version numbers are shared with the code under
test. The emulator must match it bitwise.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.func import functional_call

from _reference import CFG, SEED, batch_fn, optim_config
from nobubble.core.ledger import Ledger
from nobubble.model import GPT, build_model, partition_layers
from nobubble.model.gpt import lm_loss, rotary_cos_sin
from nobubble.optim import build_optimizer, lr_at
from test_emulator_oracles import emulate

Weights = dict[str, torch.Tensor]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def stage_names(model: GPT, num_stages: int) -> list[list[str]]:
    """Full-model parameter names held by each stage: embedding on the first, norm and head on
    the last, the blocks of the default partition in between."""
    ranges = partition_layers(CFG, num_stages)
    names: list[list[str]] = [[] for _ in range(num_stages)]
    for name, _ in model.named_parameters():
        if name.startswith("embed."):
            names[0].append(name)
        elif name.startswith(("norm.", "head.")):
            names[-1].append(name)
        else:
            layer = int(name.split(".")[1])
            names[next(s for s, r in enumerate(ranges) if layer in r)].append(name)
    return names


def _sub(weights: Weights, prefix: str) -> Weights:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def stage_forward(
    model: GPT, stage: int, num_stages: int, weights: Weights, x: torch.Tensor, m: int
) -> torch.Tensor:
    """Stage ``stage`` of the unsplit model at ``weights``: hidden states (B, T, D) out, or on
    the last stage the micro-batch's mean loss."""
    ranges = partition_layers(CFG, num_stages)
    h = functional_call(model.embed, _sub(weights, "embed."), (x,)) if stage == 0 else x
    cos, sin = rotary_cos_sin(h.shape[1], CFG.head_dim, CFG.rope_theta, h.device)
    for i in ranges[stage]:
        h = functional_call(model.layers[str(i)], _sub(weights, f"layers.{i}."), (h, cos, sin))
    if stage < num_stages - 1:
        return h
    h = functional_call(model.norm, _sub(weights, "norm."), (h,))
    logits = functional_call(model.head, _sub(weights, "head."), (h,))
    return lm_loss(logits, batch_fn(m)[1])


def recompute_reference(
    ledger: Ledger, num_stages: int, num_microbatches: int, num_steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PACI with recompute from its definition: (loss of every forward, final weights)."""
    P, M = num_stages, num_microbatches
    ocfg = optim_config("adamw")
    model = build_model(CFG, SEED)
    masters = dict(model.named_parameters())
    names = stage_names(model, P)
    opts = [build_optimizer(ocfg, [(n, masters[n]) for n in names[s]]) for s in range(P)]

    def snapshot(s: int) -> Weights:
        return {n: masters[n].detach().clone() for n in names[s]}

    versions = [[snapshot(s)] for s in range(P)]  # versions[s][v]: stage s after v steps
    losses: list[float] = []
    for j in range(num_steps):
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(P)]
        for m in range(j * M, (j + 1) * M):
            inputs = [batch_fn(m)[0]]  # inputs[s]: what stage s's forward received
            with torch.no_grad():
                for s in range(P):
                    v = ledger.stages[s].fwd_version[m]
                    bound = -(-(P - 1 - s) // M)  # ceil((P-1-s)/a): paper B's drift bound
                    assert j - bound <= v <= j, f"stage {s}: version {v} for batch {j}"
                    out = stage_forward(model, s, P, versions[s][v], inputs[s], m)
                    inputs.append(out)
            losses.append(float(out))  # the loss of the forward, at its own weights
            grad_out: torch.Tensor | None = None
            for s in reversed(range(P)):
                assert ledger.stages[s].bwd_version[m] == j, "backward off the synchronous version"
                leaves = {n: masters[n].detach().requires_grad_(True) for n in names[s]}
                x = inputs[s] if s == 0 else inputs[s].detach().requires_grad_(True)
                out = stage_forward(model, s, P, leaves, x, m)  # rebuilt at version j
                if s == P - 1:
                    out = out / M  # the batch loss is the mean over its micro-batches
                wrt = list(leaves.values()) + ([x] if s > 0 else [])
                got = torch.autograd.grad(out, wrt, grad_outputs=grad_out)
                for n, g in zip(names[s], got[: len(names[s])], strict=True):
                    grads[s][n] = g if n not in grads[s] else grads[s][n] + g
                grad_out = got[-1] if s > 0 else None
        for s in range(P):
            for n in names[s]:
                masters[n].grad = grads[s][n]
            opts[s].set_lr(lr_at(j, num_steps, ocfg))
            opts[s].step()
            opts[s].zero_grad(set_to_none=True)
            versions[s].append(snapshot(s))
    return losses, {n: p.detach().clone() for n, p in masters.items()}


@pytest.mark.parametrize(("num_stages", "accum"), [(2, 2), (2, 4), (4, 2), (4, 4)])
def test_emulated_recompute_equals_the_definition_bitwise(num_stages: int, accum: int) -> None:
    steps = 5
    run = emulate("paci", num_stages, accum, steps, accum=accum, recompute=True)
    crossed = [c for st in run.ledger.stages for c in st.crossed]
    assert max(crossed) >= 1, "no micro-batch crossed an update: the test proves nothing"
    losses, params = recompute_reference(run.ledger, num_stages, accum, steps)
    assert run.losses == losses
    assert run.params.keys() == params.keys()
    for n, p in params.items():
        assert torch.equal(run.params[n], p), f"{n} differs from the definition"


def test_the_reference_sees_the_crossed_updates() -> None:
    """Guard against a vacuous reference: reading the backward's version at forward time too
    (no crossed update, i.e. synchronous training) gives other numbers."""
    run = emulate("paci", 4, 4, 5, accum=4, recompute=True)
    sync = emulate("1f1b", 4, 4, 5)
    gap = max(float((run.params[n] - p).abs().max()) for n, p in sync.params.items())
    assert gap > 1e-4, f"recompute paci equals flush ({gap:.1e})"


def test_the_reported_loss_is_the_forward_loss() -> None:
    """The last stage never crosses an update, so the loss its forward reports is the loss its
    backward differentiates: the train loss of a recompute run is not a stale number."""
    run = emulate("paci", 4, 4, 5, accum=4, recompute=True)
    last = run.ledger.stages[-1]
    assert last.fwd_version == last.bwd_version
    assert all(c == 0 for c in last.crossed)
