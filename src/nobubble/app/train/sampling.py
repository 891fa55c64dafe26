"""The text sample a run ends with, drawn through the pipeline's own forwards
(``Pipeline.generate``): under ``--runtime dist`` every rank runs only its stages, so no process
holds the whole model for it."""

from __future__ import annotations

from nobubble.api.pipeline import Pipeline
from nobubble.app.train.assemble import Plan
from nobubble.data import TokenData


def sample(
    plan: Plan,
    pipe: Pipeline,
    data: TokenData,
    prompt: str = "ROMEO:",
    temperature: float = 0.8,
    top_k: int = 50,
) -> str | None:
    """A short seeded sample from the trained model, for people to read (a collective under
    runtime="dist": every rank calls it and gets the text)."""
    if data.tokenizer is None or plan.cfg.run.sample_tokens == 0:
        return None
    ids = pipe.generate(
        data.tokenizer.encode(prompt),
        plan.cfg.run.sample_tokens,
        context=plan.cfg.data.seq_len,
        temperature=temperature,
        top_k=top_k,
        seed=plan.cfg.run.seed,
    )
    return data.tokenizer.decode(ids)
