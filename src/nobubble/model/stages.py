"""Pipeline split of a GPT into stage modules that keep the full model's parameter names."""

from __future__ import annotations

import copy

import torch
from torch import nn

from nobubble.model.config import ModelConfig
from nobubble.model.gpt import GPT, check_seq_len, check_token_ids, lm_loss, run_layers
from nobubble.model.partition import check_layer_ranges, partition_layers


class StageModule(nn.Module):
    """Stage ``stage`` of ``num_stages``: a contiguous slice of blocks, plus the embedding on
    the first stage and the final norm, head and loss on the last (one stage: all of them).

    forward(x, targets=None): the first stage takes token ids (B, T) int64, the others hidden
    states (B, T, D); the last stage returns the logits (B, T, V), or with ``targets`` the scalar
    mean cross-entropy (``lm_loss``, the pipeline's loss function for this model); the others
    return hidden states (B, T, D).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        stage: int,
        num_stages: int,
        layers: nn.ModuleDict,
        embed: nn.Embedding | None = None,
        norm: nn.RMSNorm | None = None,
        head: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} must lie in 0..num_stages-1 = 0..{num_stages - 1}")
        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        # Assert, not ValueError: split_model is the public way to build stages.
        assert (embed is not None) == self.is_first, "embed belongs to stage 0 only"
        assert (norm is not None) == (head is not None) == self.is_last, "norm+head: last only"
        self.layer_ids: tuple[int, ...] = tuple(int(key) for key in layers)
        if embed is not None:
            self.embed = embed
        self.layers = layers
        if norm is not None and head is not None:
            self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            check_token_ids(x, self.cfg, f"stage {self.stage} input")
            h = self.embed(x)  # (B, T, D)
        else:
            self._check_hidden(x)
            h = x
        h = run_layers(self.layers, h, self.cfg)
        if not self.is_last:
            return h
        logits = self.head(self.norm(h))
        return logits if targets is None else lm_loss(logits, targets)

    def _check_hidden(self, x: torch.Tensor) -> None:
        if not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != self.cfg.dim:
            raise ValueError(
                f"stage {self.stage} input must be hidden states (batch, seq, dim={self.cfg.dim}) "
                f"of a floating dtype, got dtype {x.dtype} and shape {tuple(x.shape)}"
            )
        check_seq_len(x.shape[1], self.cfg)

    def extra_repr(self) -> str:
        return f"stage={self.stage}/{self.num_stages}, layer_ids={self.layer_ids}"


def split_model(
    model: GPT, num_stages: int, layer_ranges: list[range] | None = None, *, share: bool = False
) -> list[StageModule]:
    """Deep copies of ``model``'s pieces as ``num_stages`` stage modules.

    Each stage is independent of ``model`` and of the others, and holds the same numbers as the
    same-named parameters of ``model``: one seed gives one initial model whatever the number of
    stages. ``layer_ranges`` defaults to partition_layers(model.cfg, num_stages). ``share``:
    the stages hold ``model``'s own modules instead of copies (``nobubble.split`` of a GPT).
    """
    cfg = model.cfg
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"num_stages must be an int, got {num_stages!r}")
    if layer_ranges is None:
        layer_ranges = partition_layers(cfg, num_stages)
    check_layer_ranges(cfg.n_layers, num_stages, layer_ranges)
    take = (lambda module: module) if share else copy.deepcopy
    stages = []
    for stage, layer_range in enumerate(layer_ranges):
        is_first, is_last = stage == 0, stage == num_stages - 1
        layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_range})
        stages.append(
            StageModule(
                cfg,
                stage,
                num_stages,
                take(layers),
                embed=take(model.embed) if is_first else None,
                norm=take(model.norm) if is_last else None,
                head=take(model.head) if is_last else None,
            )
        )
    return stages


def compute_cost(module: nn.Module) -> int:
    """A module's compute per token, estimated as one multiply-add per parameter outside
    embeddings (a lookup costs nothing). What a balanced split balances."""
    lookups = {
        id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    return sum(p.numel() for p in module.parameters() if id(p) not in lookups)
