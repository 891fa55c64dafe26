"""``Pipeline.evaluate``, ``predict`` and ``generate``: the loss of a batch, the last stage's
output, and token ids sampled from it, on the current weights, forwards only, stage to stage;
the one forward-only path of both runtimes (the emulator here, the ranks' runner under
runtime="dist"), where no rank holds more than its own stages."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nobubble.api.steps import StepLoop, split_tree
from nobubble.engine.tree import Tree


class Evaluation(StepLoop):
    def evaluate(
        self, inputs: Tree, targets: Tree, microbatches: int | None = None
    ) -> float | None:
        """The loss of a batch on the current weights: forwards only, stage to stage, in eval
        mode, changing no training state. The batch is cut into ``microbatches`` pieces (the
        pipeline's M by default) along dim 0; the result is the mean of their losses, as a
        step's loss is. Needs a drained pipeline. With runtime="dist", call it on every rank
        with the same batch: the rank of the last stage returns the loss (the last rank; rank 0
        under zbv's V), the others None."""
        self._check_drained("evaluate()")
        m = self.microbatches if microbatches is None else microbatches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"microbatches={m!r} is not allowed: use an integer >= 1")
        pieces = list(
            zip(split_tree(inputs, m, "inputs"), split_tree(targets, m, "targets"), strict=True)
        )
        losses = self._forwards(pieces, outputs=False)
        if losses is None:
            return None
        values = torch.stack([loss.detach().float().reshape(()) for loss in losses]).cpu().tolist()
        return sum(values) / len(values)

    def predict(self, inputs: Tree) -> Tree | None:
        """The last stage's output for ``inputs`` on the current weights: forwards only, stage
        to stage, in eval mode, changing no training state (the batch as one piece). Needs a
        drained pipeline. With runtime="dist", call it on every rank with the same inputs: the
        rank of the last stage returns the output, the others None; no rank holds more than
        its own stages."""
        self._check_drained("predict()")
        out = self._forwards([(inputs, None)], outputs=True)
        return None if out is None else out[0]

    @torch.no_grad()
    def generate(
        self,
        ids: Sequence[int],
        new_tokens: int,
        *,
        context: int | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> list[int]:
        """``ids`` followed by ``new_tokens`` token ids sampled from a language model whose last
        stage outputs logits (batch, time, vocabulary): each token is one ``predict`` of the
        last ``context`` ids (all of them when None), drawn from the last position's logits
        divided by ``temperature`` and cut to the ``top_k`` most likely (None: all), with a
        generator seeded by ``seed``. With runtime="dist", call it on every rank: the rank of
        the last stage draws each token and the others receive it, so every rank returns the
        same ids, and no rank holds more than its own stages."""
        check_sampling(ids, new_tokens, context, temperature, top_k)
        self._check_drained("generate()")
        out = [int(i) for i in ids]
        gen = torch.Generator().manual_seed(seed)
        for _ in range(new_tokens):
            window = out[-context:] if context else out
            logits = self.predict(torch.tensor([window]))
            token = None if logits is None else draw(logits, gen, temperature, top_k)
            if self.rank is not None:
                token = self.emulator.from_last_stage(token)
            if token is None or token < 0:
                raise TypeError(
                    "generate() needs the last stage to output logits shaped (batch, time, "
                    f"vocabulary); it output {describe(logits)}"
                )
            out.append(token)
        return out

    def _forwards(self, pieces: list[tuple[Tree, Tree]], outputs: bool) -> list[Tree] | None:
        """Forwards of ``pieces`` through the stages in eval mode: the losses (or with
        ``outputs`` the last stage's outputs) on the rank of the last stage, None elsewhere."""
        modes = [(w.module, w.module.training) for w in self.workers]
        for module, _ in modes:
            module.eval()
        try:
            if self.rank is not None:
                return self.emulator.evaluate(pieces, outputs)
            results = []
            for x, y in pieces:
                h = x
                for worker in self.workers:
                    h = worker.infer(h, y, outputs)
                results.append(h)
            return results
        finally:
            for module, training in modes:
                module.train(training)


def check_sampling(
    ids: Sequence[int],
    new_tokens: int,
    context: int | None,
    temperature: float,
    top_k: int | None,
) -> None:
    """Refuse ``generate()``'s arguments before any forward, with the fix."""
    if isinstance(ids, torch.Tensor) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"ids={ids!r}: give the prompt as a non-empty list of token ids")
    checks = [("new_tokens", new_tokens, 0), ("context", context, 1), ("top_k", top_k, 1)]
    for name, value, least in checks:
        if value is None and name != "new_tokens":  # context and top_k: None means all
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r}: use an integer >= {least}")
    if not (
        isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature={temperature!r}: use a finite number > 0")


def draw(logits: Tree, gen: torch.Generator, temperature: float, top_k: int | None) -> int:
    """A token drawn from the last position's logits; -1 for an output that is not logits."""
    if not (isinstance(logits, torch.Tensor) and logits.ndim == 3 and logits.is_floating_point()):
        return -1
    last = logits[0, -1].float().cpu() / temperature
    if top_k is not None and top_k < last.numel():
        kth = torch.topk(last, top_k).values[-1]
        last = last.masked_fill(last < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(last, dim=-1), 1, generator=gen))


def describe(value: Tree) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "something else" if value is None else type(value).__name__
