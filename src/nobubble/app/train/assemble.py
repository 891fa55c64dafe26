"""Build the pieces of a run from a ``TrainConfig``: data, model stages, the pipeline.

Shared by the emulator (all stages in one process) and the multi-process runtime (one stage per
rank), so both start from the same numbers: same seed, same split, same configuration. The run's
schedule is the pipeline's, the one that runs: nothing here builds another.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nobubble.api.materializing import materialize, remember
from nobubble.api.pipeline import Observer, Pipeline
from nobubble.app.train.config import TrainConfig
from nobubble.core.ir import Schedule
from nobubble.core.placement import Placement
from nobubble.core.validate import validate
from nobubble.data import TokenData, prepare_data
from nobubble.model import (
    GPT,
    ModelConfig,
    StageModule,
    build_model,
    describe_partition,
    lm_loss,
    model_config,
    partition_layers,
    split_model,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What every rank agrees on before training: the placement, model shape and split."""

    cfg: TrainConfig
    placement: Placement
    model_cfg: ModelConfig | None  # None for a Hugging Face model (--model hf:PATH)
    layer_ranges: list[range]  # the internal GPT's; a Hugging Face split's are in Model

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def drain_points(self) -> list[int]:
        """Steps after which nothing is in flight: evaluation and checkpoint points."""
        every = self.cfg.run.eval_every
        return sorted({*range(every, self.cfg.run.steps, every), self.cfg.run.steps})


def make_schedule(cfg: TrainConfig) -> Schedule:
    """The whole schedule of a run of ``cfg`` as its pipeline runs it (drained at the drain
    points), for what looks at a run from outside: projections and tests of the parts."""
    drain = None if cfg.schedule.info.synchronous else cfg.run.eval_every
    schedule = cfg.pipeline_config().generate(
        cfg.num_ranks, cfg.run.steps, drain_every=drain, max_actions=None
    )
    validate(schedule)
    return schedule


def make_plan(cfg: TrainConfig, vocab_size: int) -> Plan:
    placement = cfg.schedule.placement(cfg.num_ranks)
    if cfg.model.is_hf:
        _check_hf_vocab(cfg, vocab_size)
        return Plan(cfg, placement, None, [])
    model_cfg = model_config(cfg.model.model, vocab_size, cfg.data.seq_len)
    ranges = partition_layers(model_cfg, placement.num_stages, seq_len=cfg.data.seq_len)  # v·P
    return Plan(cfg, placement, model_cfg, ranges)


def _check_hf_vocab(cfg: TrainConfig, vocab_size: int) -> None:
    """The data's token ids must fit the Hugging Face model's embedding."""
    from nobubble.model.hf import config_vocab

    model_vocab = config_vocab(cfg.hf_config())
    if vocab_size > model_vocab:
        raise ValueError(
            f"the data's tokenizer has {vocab_size:,} tokens, more than the {model_vocab:,} of "
            f"--model {cfg.model.model}: use --vocab-size {model_vocab} or less"
        )


@dataclass
class Model:
    """The model of a run, cut into stages; ``whole`` is a Hugging Face model the stages share
    (None for the internal GPT, whose stages are copies merged back for evaluation)."""

    stages: list[nn.Module]
    whole: Any | None
    layer_ranges: list[range]
    num_params: int


def make_model(
    plan: Plan, local: Sequence[int] | None = None, device: torch.device | None = None
) -> Model:
    """The model of the run, cut into its stages.

    ``local`` None (the emulator): every stage, built as a whole. Given (a rank of the
    multi-process runtime): the model is built on the meta device and only the stages ``local``
    get tensors, on ``device``: a Hugging Face folder's safetensors are read for those stages
    only, and a model without weights is initialized from the seed exactly as the whole model's
    build would (``nobubble.materialize``); the other stages stay on meta.
    """
    if local is not None and plan.model_cfg is not None:
        return _gpt_per_stage(plan, local, device)
    if local is not None:
        path = plan.cfg.model.model.removeprefix("hf:")
        from nobubble.model.hf import weights_of

        try:
            weights = weights_of(path)
        except ValueError as err:  # pytorch_model.bin: readable whole only
            log.warning("%s; every rank loads the whole model instead", err)
        else:
            return _hf_per_stage(plan, local, device, weights)
    model = _whole_model(plan)
    if local is not None:
        from nobubble.runtime.distributed.join import release_others

        release_others(model.stages, local)
        for s in local:
            model.stages[s] = model.stages[s].to(device)
    return model


def _whole_model(plan: Plan) -> Model:
    if plan.model_cfg is not None:
        num_params = plan.model_cfg.num_params()
        modules: list[nn.Module] = list(make_stages(plan))
        return Model(modules, None, plan.layer_ranges, num_params)
    from nobubble.api.splitting import split
    from nobubble.model.hf import load_model

    cfg = plan.cfg
    whole = load_model(cfg.model.model.removeprefix("hf:"), seed=cfg.run.seed)
    stages = split(whole, cfg.model_stages, untie=cfg.model.untie_embeddings)
    return _hf_model(plan, stages, whole)


def _hf_model(plan: Plan, stages: list[nn.Module], whole: Any) -> Model:
    ids: list[tuple[int, ...]] = [getattr(s, "layer_ids") for s in stages]  # noqa: B009
    ranges = [range(i[0], i[-1] + 1) for i in ids]
    num_params = sum(p.numel() for p in whole.parameters())
    log.info(
        "model %s: %.2fM parameters, blocks per stage %s",
        plan.cfg.model.model,
        num_params / 1e6,
        [f"{r.start}-{r.stop - 1}" for r in ranges],
    )
    return Model(stages, whole, ranges, num_params)


def _hf_per_stage(
    plan: Plan, local: Sequence[int], device: torch.device | None, weights: Path | None
) -> Model:
    from nobubble.api.splitting import split
    from nobubble.model.hf import meta_model

    cfg = plan.cfg
    whole = meta_model(cfg.model.model.removeprefix("hf:"))
    stages = split(whole, cfg.model_stages, untie=cfg.model.untie_embeddings)
    seed = None if weights is not None else cfg.run.seed
    materialize(stages, local, seed=seed, weights=weights, device=device or "cpu")
    model = _hf_model(plan, stages, whole)
    model.whole = None  # on meta but for this rank's stages: nothing to evaluate whole
    return model


def _gpt_per_stage(plan: Plan, local: Sequence[int], device: torch.device | None) -> Model:
    assert plan.model_cfg is not None
    with torch.device("meta"):
        gpt = GPT(plan.model_cfg)
    stages = split_model(gpt, plan.num_stages, plan.layer_ranges, share=True)
    remember(stages, gpt)
    materialize(stages, local, seed=plan.cfg.run.seed, device=device or "cpu")
    return Model(list(stages), None, plan.layer_ranges, plan.model_cfg.num_params())


def load_data(cfg: TrainConfig) -> TokenData:
    data = prepare_data(cfg.data_config())
    _check_val_split(cfg, data)
    return data


def _check_val_split(cfg: TrainConfig, data: TokenData) -> None:
    """Refuse data whose validation split holds less than one micro-batch of windows now,
    before training, rather than at the first evaluation."""
    windows, batch = data.num_val_windows, cfg.global_micro_batch_size
    if windows >= batch:
        return
    longest = (data.num_val_tokens - 1) // batch  # the most tokens per window that fit B windows
    fixes = [f"--seq-len {longest} or less"] if longest >= 1 else []
    fixes += [f"--micro-batch-size {windows} or less"] if windows >= 1 else []
    raise ValueError(
        f"--seq-len {cfg.data.seq_len} cuts the {data.num_val_tokens:,} validation tokens of "
        f"--data {cfg.data.data} into {windows} windows of seq-len + 1 tokens, fewer than one "
        f"micro-batch of --micro-batch-size {batch} for evaluation: use "
        + ", or ".join([*fixes, "more text"])
    )


def make_stages(plan: Plan) -> list[StageModule]:
    """All stage modules; each rank of the runtime keeps only its own."""
    assert plan.model_cfg is not None, "the internal GPT's stages"
    model = build_model(plan.model_cfg, plan.cfg.run.seed)
    log.info(
        "model %s: %.2fM parameters, split over %d stages:\n%s",
        plan.cfg.model.model,
        plan.model_cfg.num_params() / 1e6,
        plan.num_stages,
        describe_partition(plan.model_cfg, plan.layer_ranges, seq_len=plan.cfg.data.seq_len),
    )
    return split_model(model, plan.num_stages, plan.layer_ranges)


def make_pipeline(plan: Plan, stages: list[nn.Module], observe: Observer | None = None) -> Pipeline:
    """The pipeline of a ``nobubble train`` run: the public API with the run's configuration
    (``TrainConfig.pipeline_config``: the recipe's warm-up and cosine learning rate, clipping,
    weight decay spelled out)."""
    return Pipeline(list(stages), lm_loss, config=plan.cfg.pipeline_config(), observe=observe)


__all__ = [
    "Model",
    "Plan",
    "load_data",
    "make_model",
    "make_pipeline",
    "make_plan",
    "make_schedule",
    "make_stages",
]
