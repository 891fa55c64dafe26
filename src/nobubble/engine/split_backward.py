"""Split backward: the input gradient now (I), the weight gradients later (W), from one graph.

Zero-bubble schedules (Qi et al., ICLR 2024, arXiv 2401.10241) run a stage's backward as two
actions: I computes the gradient the previous stage waits for, W the weight gradients that only
this stage's next step needs, later, in what would be a bubble. Both walk the forward's autograd
graph; W must not redo I's work.

A weight's gradient is computed inside a node that also carries the activation gradient (a
matmul's backward gives dX and dW), so the graph is cut at such nodes. Each node is summarised
by the leaves it reaches: one weight (a *weight-side* node: the weight's accumulator, a transpose
of the weight, ...) or more than one leaf (activation-side; the stage input is a leaf too). A
*boundary* is an activation-side node with a weight-side child. I runs autograd from the outputs
to the stage inputs and captures the gradient arriving at every boundary (autograd runs a
boundary there only for its activation-side children, if at all); W re-enters the graph at the
boundaries with those gradients. On the first stage, whose input takes no gradient, I thus
carries the gradient down to the boundaries and W does the rest. A weight entered from several
activation-side nodes (the embedding, read by every consumer of the residual stream) is entered
below them instead, where its paths meet (see ``_groups``).

W makes one autograd call per group of boundaries that share weights, with only the group's
weights as inputs, so a call never re-runs the activation path towards another group's weights.
Inside a group, a boundary below another would receive the gradient twice (captured, and again
from the upper boundary); a pre-hook pins it to the captured one, as torch's pipelining does.
Each boundary runs the same kernels on the same incoming gradient as the fused backward, so the
weight gradients are bitwise those of B.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_MANY = object()  # a node that reaches more than one leaf


def _leaf_summaries(roots: Sequence[Node]) -> dict[Node, object]:
    """For every node under ``roots``: the one leaf node it reaches, ``_MANY``, or None."""
    summary: dict[Node, object] = {}
    stack: list[tuple[Node, bool]] = [(n, False) for n in roots]
    while stack:  # iterative post-order: graphs are deeper than Python's recursion limit
        node, expanded = stack.pop()
        if node in summary:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in summary)
            continue
        if not children:
            summary[node] = node  # an accumulator: a weight, the stage input, another leaf
            continue
        reached: object = None
        for child in children:
            below = summary[child]
            if below is None or below is reached:
                continue
            reached = below if reached is None else _MANY
        summary[node] = reached
    return summary


@dataclass
class WeightWork:
    """What I leaves for W: per group, the boundary edges with their captured gradients, and
    the indices (into the stage's weight list) of the group's weights; or, on a stage whose
    inputs take no gradient, the whole backward (``whole``: the outputs and their gradients)."""

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[int]]]
    num_weights: int
    whole: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None


def _groups(
    summary: dict[Node, object], weight_nodes: dict[Node, int]
) -> list[tuple[list[Node], list[int]]]:
    """Where W re-enters the graph, joined into groups that share weights, with each group's
    weights.

    A weight entered by one activation-side edge is entered at that edge's node, the boundary.
    One entered by several (the first stage's embedding: every consumer of the residual stream
    reads its output) is entered below them, at the top of the chain of weight-side nodes that
    every path to it takes, with the sum of its gradients: W then never re-runs the activation
    path between those consumers, and I pays only their shares of the activation gradient."""
    entries: Counter[object] = Counter()  # weight -> activation-side edges into its side
    parents: Counter[Node] = Counter()  # weight-side node -> edges into it
    parent: dict[Node, Node] = {}
    for node, reached in summary.items():
        for child, _ in node.next_functions:
            if child is None or summary[child] not in weight_nodes:
                continue
            parents[child] += 1
            parent[child] = node
            if reached is _MANY:
                entries[summary[child]] += 1
    boundaries: list[tuple[Node, list[int]]] = []
    for leaf, count in entries.items():
        if count > 1:
            top = cast(Node, leaf)
            while parents[top] == 1 and summary[parent[top]] is not _MANY:
                top = parent[top]
            boundaries.append((top, [weight_nodes[leaf]]))  # type: ignore[index]
    for node, reached in summary.items():
        if reached is _MANY:
            below = {summary[c] for c, _ in node.next_functions if c is not None}
            weights = sorted(weight_nodes[b] for b in below if entries.get(b) == 1)  # type: ignore[index]
            if weights:
                boundaries.append((node, weights))
    root = list(range(len(weight_nodes)))  # union-find over weight indices

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for _, weights in boundaries:
        for w in weights[1:]:
            root[find(w)] = find(weights[0])
    groups: dict[int, tuple[list[Node], set[int]]] = {}
    for node, weights in boundaries:
        nodes, members = groups.setdefault(find(weights[0]), ([], set()))
        nodes.append(node)
        members.update(weights)
    return [(nodes, sorted(members)) for nodes, members in groups.values()]


def _listed(grads: Sequence[torch.Tensor] | None) -> list[torch.Tensor] | None:
    return None if grads is None else list(grads)


def input_backward(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], WeightWork]:
    """I: the gradients of ``inputs`` (zeros for an input the outputs do not use, as the fused
    backward's), and what W needs; the graph is retained for W.

    Without inputs (the first stage: token ids take no gradient) nobody waits for I, so it
    does nothing and W runs the whole backward, the fused B's own call: cutting it would only
    add the boundary captures' cost (torch's pipelining does the same)."""
    if not inputs:
        return [], WeightWork([], len(weights), (list(outputs), _listed(grad_outputs)))
    roots = [get_gradient_edge(t) for t in outputs]
    summary = _leaf_summaries([edge.node for edge in roots])
    weight_nodes = {get_gradient_edge(w).node: i for i, w in enumerate(weights)}
    groups = _groups(summary, weight_nodes)
    capture = [
        GradientEdge(node, k)
        for nodes, _ in groups
        for node in nodes
        for k in range(len(node._input_metadata))
    ]
    seeds = list(grad_outputs) if grad_outputs is not None else [torch.ones_like(outputs[0])]
    # an output that is itself weight-side goes to W with its own gradient, as a boundary would
    direct = [(e, g) for e, g in zip(roots, seeds, strict=True) if summary[e.node] in weight_nodes]
    grads: Sequence[torch.Tensor | None] = ()
    if inputs or capture:
        grads = torch.autograd.grad(
            outputs,
            [*inputs, *capture],  # type: ignore[arg-type]  # tensors and edges mix at run time
            grad_outputs=grad_outputs,
            retain_graph=True,
            allow_unused=True,
        )
    grads_in = [
        torch.zeros_like(x) if g is None else g
        for x, g in zip(inputs, grads[: len(inputs)], strict=True)
    ]
    captured = iter(grads[len(inputs) :])
    work = WeightWork([], len(weights))
    for nodes, members in groups:
        edges, seen = [], []
        for node in nodes:
            for k in range(len(node._input_metadata)):
                g = next(captured)
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    seen.append(g)
        work.groups.append((edges, seen, members))
    for edge, g in direct:
        work.groups.append(([edge], [g], [weight_nodes[summary[edge.node]]]))  # type: ignore[index]
    return grads_in, work


def weight_backward(work: WeightWork, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """W: every weight's gradient (zeros for a weight the outputs do not use, as B's)."""
    if work.whole is not None:
        outputs, grad_outputs = work.whole
        found = torch.autograd.grad(
            outputs, list(weights), grad_outputs=grad_outputs, materialize_grads=True
        )
        return list(found)
    grads: list[torch.Tensor | None] = [None] * work.num_weights
    for edges, seen, members in work.groups:
        if not edges:
            continue
        handles = []
        if len(edges) > 1:  # pin each boundary to its captured gradient (see the module doc)
            pinned: dict[Node, list[torch.Tensor | None]] = {}
            for edge, g in zip(edges, seen, strict=True):
                slots = pinned.setdefault(edge.node, [None] * len(edge.node._input_metadata))
                slots[edge.output_nr] = g
            for node, slots in pinned.items():
                handles.append(node.register_prehook(lambda _, s=tuple(slots): s))
        try:
            found = torch.autograd.grad(
                edges,
                [weights[i] for i in members],
                grad_outputs=seen,
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        for i, g in zip(members, found, strict=True):
            previous = grads[i]  # a weight-side output's weight may be a group's too
            if g is not None:
                grads[i] = g if previous is None else previous + g
    return [torch.zeros_like(w) if g is None else g for w, g in zip(weights, grads, strict=True)]
