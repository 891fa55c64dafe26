"""AdaMuon (arXiv 2507.11005), registered from pytorch-optimizer by its registry entry alone.

The stage optimizer must step the hidden matrices exactly as the library's AdaMuon stepping them
alone does, and everything else exactly as AdamW does; the rest (a missing library, checkpoints,
learning, the schedule's lr) is covered by test_optim_library.py's tests over every library
optimizer, which the entry joins.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from nobubble.model import GPT, model_config
from nobubble.optim import OPTIMIZERS, OptimConfig, build_optimizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_optimizer") is None,
    reason="the optim extra is not installed: pip install 'nobubble[optim]'",
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(model_config("tiny", 128, 16))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.roll(-1, 1).ravel())


def test_adamuon_is_a_choice_of_the_command_line():
    from nobubble.app.train.flags import build_train_parser

    assert "adamuon" in OPTIMIZERS
    args = build_train_parser().parse_args(["--optimizer", "adamuon"])
    assert args.optimizer == "adamuon"


def test_adamuon_steps_the_matrices_as_the_library_and_the_rest_as_adamw():
    import pytorch_optimizer

    lr, decay = 3e-3, 0.1
    ours, ref = _model(), _model()
    opt = build_optimizer(
        OptimConfig(name="adamuon", lr=lr, weight_decay=decay), ours.named_parameters()
    )
    assert isinstance(opt.parts["muon"], pytorch_optimizer.AdaMuon)
    assert opt.routing.muon and all(n.startswith("layers.") for n in opt.routing.muon)
    assert {"embed.weight", "head.weight"} <= set(opt.routing.adamw)
    # the reference: the library's AdaMuon on the same matrices, torch's AdamW on the rest,
    # with the project's decay policy (2-D tensors only) written out here
    by_name = dict(ref.named_parameters())

    def groups(names: tuple[str, ...]) -> list[dict]:
        tensors = [by_name[n] for n in names]
        return [
            {"params": [p for p in tensors if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in tensors if p.dim() < 2], "weight_decay": 0.0},
        ]

    matrices = pytorch_optimizer.AdaMuon(
        [{**g, "use_muon": True} for g in groups(opt.routing.muon) if g["params"]],
        lr=lr,
        betas=(0.9, 0.95),
        use_adjusted_lr=True,
    )
    rest = [g for g in groups(opt.routing.adamw) if g["params"]]
    adamw = torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        for model, steppers in ((ours, [opt]), (ref, [matrices, adamw])):
            _loss(model, step).backward()
            for stepper in steppers:
                stepper.step()
                stepper.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name
