"""The whole model of a run's stages and text sampled from it: the merged weights, the model they
make (the internal GPT or the Hugging Face model, logits only), and the sample a run ends with."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

from nobubble.app.train.assemble import Model, Plan
from nobubble.data import TokenData
from nobubble.model import GPT, lm_loss


def merged_model(plan: Plan, state: dict[str, torch.Tensor]) -> GPT:
    """One GPT from the stages' weights (parameter names do not depend on the split)."""
    assert plan.model_cfg is not None, "a Hugging Face model is evaluated as itself"
    model = GPT(plan.model_cfg)
    model.load_state_dict(state)
    return model.eval()


class HFLogits(torch.nn.Module):
    """A Hugging Face causal LM seen as the internal GPT is: ``model(ids)`` gives logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(ids).logits
        return logits if targets is None else lm_loss(logits, targets)


@contextlib.contextmanager
def whole_model(plan: Plan, model: Model) -> Iterator[torch.nn.Module]:
    """The whole model in eval mode, for validation and samples: the GPT merged from its stages,
    or the Hugging Face model the stages share (back in train mode afterwards)."""
    if model.whole is None:
        yield merged_model(plan, merged_state(model.stages))
        return
    model.whole.eval()
    try:
        yield HFLogits(model.whole)
    finally:
        model.whole.train()


def merged_state(stages: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for stage in stages:
        state.update(stage.state_dict())
    return state


def sample_from_state(plan: Plan, state: dict[str, torch.Tensor], data: TokenData) -> str | None:
    """A short seeded sample from the whole model with the weights ``state``."""
    if data.tokenizer is None or plan.cfg.sample_tokens == 0:
        return None
    if plan.model_cfg is not None:
        return sample(plan, merged_model(plan, state), data)
    from nobubble.model.hf import load_model, untie_embeddings

    whole = load_model(plan.cfg.model.removeprefix("hf:"), seed=plan.cfg.seed)
    if plan.cfg.untie_embeddings:
        untie_embeddings(whole)
    whole.load_state_dict(state)
    return sample(plan, HFLogits(whole.eval()), data)


@torch.no_grad()
def sample(
    plan: Plan,
    model: torch.nn.Module,
    data: TokenData,
    prompt: str = "ROMEO:",
    temperature: float = 0.8,
    top_k: int = 50,
) -> str | None:
    """A short seeded sample from the trained model, for people to read."""
    if data.tokenizer is None or plan.cfg.sample_tokens == 0:
        return None
    ids = data.tokenizer.encode(prompt)
    gen = torch.Generator().manual_seed(plan.cfg.seed)
    for _ in range(plan.cfg.sample_tokens):
        context = torch.tensor([ids[-plan.cfg.seq_len :]])
        logits = model(context)[0, -1] / temperature  # (V,)
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        probs = torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return data.tokenizer.decode(ids)
