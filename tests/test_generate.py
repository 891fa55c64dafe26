"""``Pipeline.predict`` and ``generate``: the last stage's output and tokens sampled from it,
through the stages' own forwards. The reference is the unsplit model with sampling written out
in plain PyTorch; the dist runtime's tokens are checked in test_api_dist.py (every rank gets
the emulated pipeline's)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nobubble
from test_api import refuses

VOCAB = 40


def language_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, VOCAB)
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def written_out(model, ids, new_tokens, context, temperature, top_k, seed):  # type: ignore[no-untyped-def]
    """Sampling from the unsplit model: the last ``context`` ids, the last position's logits
    over the temperature, all but the top k masked, one multinomial draw per token."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids[-context:]]))[0, -1] / temperature
            if top_k is not None:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return ids


def trained_pipeline(schedule: str) -> tuple[nobubble.Pipeline, nn.Module]:
    model = language_model()
    pipe = nobubble.Pipeline(nobubble.split(model, ["2"]), lm_loss, schedule=schedule, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (8, 6), generator=gen)
        pipe.step(x, x.roll(-1, 1))
    pipe.drain()
    return pipe, model


@pytest.mark.parametrize(
    ("schedule", "temperature", "top_k"), [("1f1b", 0.8, 5), ("paci", 1.0, None)]
)
def test_generate_draws_as_sampling_written_out_on_the_unsplit_model(schedule, temperature, top_k):
    pipe, model = trained_pipeline(schedule)  # the stages share the model's modules
    ids = pipe.generate([3, 1, 4], 12, context=6, temperature=temperature, top_k=top_k, seed=7)
    assert ids == written_out(model, [3, 1, 4], 12, 6, temperature, top_k, 7)
    assert ids[:3] == [3, 1, 4] and len(ids) == 15
    x = torch.tensor([ids[-6:]])
    assert torch.equal(pipe.predict(x), model(x).detach())
    assert all(m.training for m in pipe.stages)  # back in train mode after the forwards


def test_generate_refuses_bad_arguments_and_an_output_that_is_not_logits():
    pipe, _ = trained_pipeline("1f1b")
    for kwargs, match in [
        ({"ids": []}, r"ids=\[\]: give the prompt as a non-empty list of token ids"),
        ({"new_tokens": -1}, r"new_tokens=-1: use an integer >= 0"),
        ({"context": 0}, r"context=0: use an integer >= 1"),
        ({"top_k": 0}, r"top_k=0: use an integer >= 1"),
        ({"temperature": 0.0}, r"temperature=0.0: use a finite number > 0"),
    ]:
        args = {"ids": [1, 2], "new_tokens": 3, **kwargs}
        refuses(match, lambda args=args: pipe.generate(args.pop("ids"), **args))
    torch.manual_seed(0)
    pooled = nn.Sequential(nn.Embedding(VOCAB, 4), nn.Flatten(), nn.Linear(8, 4))
    regression = nobubble.Pipeline(nobubble.split(pooled, ["2"]), F.mse_loss)
    refuses(
        r"generate\(\) needs the last stage to output logits shaped \(batch, time, vocabulary\); "
        r"it output a torch.float32 tensor of shape \(1, 4\)",
        lambda: regression.generate([1, 2], 1),
        TypeError,
    )
