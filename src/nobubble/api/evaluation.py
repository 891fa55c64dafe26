"""``Pipeline.evaluate``: the loss of a batch on the current weights, forwards only, stage to
stage; the one validation path of both runtimes (the emulator here, the ranks' runner under
runtime="dist")."""

from __future__ import annotations

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
        modes = [(w.module, w.module.training) for w in self.workers]
        for module, _ in modes:
            module.eval()
        try:
            if self.rank is not None:
                losses = self.emulator.evaluate(pieces)
            else:
                losses = []
                for x, y in pieces:
                    h = x
                    for worker in self.workers:
                        h = worker.infer(h, y)
                    losses.append(h)
        finally:
            for module, training in modes:
                module.train(training)
        if losses is None:
            return None
        values = torch.stack([loss.detach().float().reshape(()) for loss in losses]).cpu().tolist()
        return sum(values) / len(values)
