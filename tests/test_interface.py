"""The public surface, frozen: the flags of every command and the keywords of ``Pipeline``.

A new option is a deliberate edit of the lists below. One name per concept: a keyword of the
pipeline that a training run sets is a ``nobubble train`` flag (and config key) of the same name.
"""

from __future__ import annotations

import argparse

import pytest

from nobubble.api.config import ALIASES, PipelineConfig
from nobubble.app.train.checkpoint import CheckpointError, check_resumable, reshaped
from nobubble.app.train.config import NOT_KEYS, TrainConfig
from nobubble.app.train.flags import FLAG_NAMES, build_train_parser
from nobubble.cli import build_parser

TRAIN_FLAGS = """
--accum --activation-checkpointing --backend --betas --bucket-mb --checkpoint-every --clip
--clip-scope --compile --config --correction --data --data-parallel --delay-lr-steps --device
--dist-timeout --dtype --ef-lambda --eval-batches --eval-every --from-json --from-torch-csv
--fused-adamw --fused-grad-accumulation --help --json --lr --master-port --micro-batch-size
--microbatches --min-lr-ratio --model --momentum --no-progress --optimizer --out --paci-recompute
--resume --runtime --sample-tokens --schedule --seed --selective-every --seq-len --shard --stages
--steps --stop-at --strict-p2p --sync-warmup --text-column --threads --tokenizer
--untie-embeddings --virtual-stages --vocab-size --warmup-frac --weight-decay
"""

COMMAND_FLAGS = {
    "schedules": "--help --json",
    "show": "--accum --columns --drain-every --format --from-json --from-torch-csv --help "
    "--microbatches --schedule --stages --steps --virtual-stages",
    "ledger": "--accum --drain-every --from-json --from-torch-csv --help --json --microbatches "
    "--schedule --stages --steps --summary-only --virtual-stages",
    "simulate": "--accum --activation-bytes --allreduce --bandwidth --bwd --drain-every "
    "--from-json --from-torch-csv --fwd --help --json --latency --microbatches --plot --schedule "
    "--stages --step-cost --steps --trace --virtual-stages --wgrad",
    "bench sim": "--accum --help --json --microbatches --schedule --stages --steps",
    "bench emulator": "--compile --help --json --micro-batch-size --microbatches --model --rounds "
    "--schedule --seq-len --stages --steps --threads",
    "bench runtime": "--allocator --data-parallel --grad-mb --help --json --micro-batch-size "
    "--microbatches --model --optimizer --rounds --schedule --seq-len --stages --steps "
    "--synthetic --threads --virtual-stages --vocab-size",
    "bench time-to-target": "--against --check-projection --equal-budget --eval-every --help "
    "--json --lean-budget --out "
    "--projection-from --rounds --seeds --show --steps --sync --train --transfers --tune "
    "--tune-factor --tune-points --tune-seeds --variants",
    "bench memory": "--activation-checkpointing --allocator --data --fused-adamw "
    "--fused-grad-accumulation --help --hidden --intermediate --json --layers --micro-batch-size "
    "--microbatches --schedule --seq-len "
    "--stages --steps --vocab-size --where",
    "train": "",  # its flags are TRAIN_FLAGS, parsed once the command is chosen
    "study": "--bench --help --json --micro-batch-size --microbatches --model --optimizer --out "
    "--runs --steps --vocab-size",
    "demo": "--help --json --out --rounds --steps",
    "experiment": "--depths --dry-run --help --jobs --json --optimizers --out --quick --regime "
    "--report-to --seeds",
    "export": "--help --hf",
}

PIPELINE_KEYWORDS = """
accum activation_checkpointing backend bucket_mb clip clip_scope compile correction data_parallel
delay_lr_steps device dist_timeout dtype ef_lambda from_json from_torch_csv fused_grad_accumulation
init lr lr_schedule microbatches optimizer optimizer_options paci_recompute runtime schedule seed
selective_every shard steps sync_warmup virtual_stages weights
"""
# keywords of the Python API alone: callables, mappings and the meta device's values, which a
# command line does not give (the training recipe derives lr from --lr and its schedule)
API_ONLY = {"init", "lr_schedule", "optimizer_options", "weights"}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--"))


def _commands(prefix: str, parser: argparse.ArgumentParser) -> dict[str, str]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix: " ".join(_flags(parser))}
    found: dict[str, str] = {}
    for name, child in subs[0].choices.items():
        found.update(_commands(f"{prefix} {name}".strip(), child))
    return found


def test_the_flags_of_nobubble_train_are_the_frozen_list():
    assert _flags(build_train_parser()) == TRAIN_FLAGS.split()


@pytest.mark.parametrize("command", sorted(COMMAND_FLAGS))
def test_the_flags_of_every_command_are_the_frozen_list(command):
    assert _commands("", build_parser())[command] == COMMAND_FLAGS[command]


def test_no_command_is_missing_from_the_frozen_list():
    assert sorted(_commands("", build_parser())) == sorted(COMMAND_FLAGS)


def test_the_pipeline_keywords_are_the_frozen_list():
    assert sorted(PipelineConfig.keywords()) == PIPELINE_KEYWORDS.split()


def test_a_pipeline_keyword_a_run_sets_has_the_flags_name():
    """One name per concept: the keyword, the config key and the flag (``--ef-lambda`` is
    ``ef_lambda``); no renaming on the way from the command line to the pipeline."""
    keys = TrainConfig.key_map()
    flags = set(TRAIN_FLAGS.split())
    for keyword in set(PipelineConfig.keywords()) - API_ONLY:
        assert keyword in keys, keyword
        assert "--" + FLAG_NAMES.get(keyword, keyword).replace("_", "-") in flags, keyword


def test_a_run_holds_the_pipelines_specs_and_routes_each_key_to_its_field():
    """TrainConfig contains the specs, not a copy of their fields: a key the pipeline reads
    lands on the field of the spec that owns it, and the pipeline gets those very specs."""
    config = TrainConfig.of(schedule="zbv", num_ranks=2, correction="none", dtype="bf16")
    owners = PipelineConfig.keywords()
    held = ("schedule", "correction", "runtime", "compute")
    for keyword, (section, name) in TrainConfig.key_map().items():
        if owners.get(keyword) in held and (owners[keyword], keyword) not in NOT_KEYS:
            assert (section, name) == (owners[keyword], keyword)
    for part in held:
        assert getattr(config.pipeline_config(), part) == getattr(config, part)
    assert config.to_json()["num_ranks"] == config.num_ranks == 2


def test_former_config_keys_still_load(tmp_path):
    """A config file, run key or checkpoint written before num_ranks was P's one name."""
    assert TrainConfig.from_mapping({"stages": 3}).num_ranks == 3
    assert TrainConfig.normalized({"stages": 3, "ef-lambda": 0.5}) == {
        "num_ranks": 3,
        "ef_lambda": 0.5,
    }
    config = TrainConfig.of(num_ranks=3)
    written = {("stages" if k == "num_ranks" else k): v for k, v in config.fingerprint().items()}
    check_resumable({"fingerprint": written}, config, tmp_path)  # an old checkpoint resumes
    check_resumable({"fingerprint": written}, TrainConfig(), tmp_path)  # at another P too
    assert reshaped({"fingerprint": written}, TrainConfig())  # ... read under P's new name
    assert not reshaped({"fingerprint": written}, config)
    with pytest.raises(CheckpointError, match="seed: checkpoint 0 vs now 1"):
        check_resumable({"fingerprint": written}, TrainConfig.of(num_ranks=3, seed=1), tmp_path)


def test_former_keywords_are_accepted_as_the_one_name():
    config = PipelineConfig.build(schedule="paci", recompute=True, timeout=5.0)
    assert config.compute.paci_recompute and config.runtime.dist_timeout == 5.0
    assert set(ALIASES.values()) <= set(PipelineConfig.keywords())
    with pytest.raises(TypeError, match="unknown keyword 'recompte'; valid keywords: accum"):
        PipelineConfig.build(recompte=True)


REFUSALS = [  # the same options, refused by the command line's config and by Pipeline
    {"schedule": "1f1b", "correction": "ef"},
    {"schedule": "paci", "clip": 1.0, "clip_scope": "global"},
    {"schedule": "paci", "correction": "ef", "delay_lr_steps": 10},
    {"schedule": "1f1b", "paci_recompute": True},
    {"schedule": "zb-h1", "fused_grad_accumulation": True},
    {"schedule": "1f1b", "accum": 2},
    {"schedule": "2bw", "microbatches": 1},
    {
        "schedule": "paci",
        "runtime": "dist",
        "data_parallel": 2,
        "shard": "fsdp",
        "optimizer": "soap",
    },
    {
        "schedule": "paci",
        "runtime": "dist",
        "data_parallel": 2,
        "shard": "fsdp",
        "optimizer": "rotation",
    },
    {
        "schedule": "paci",
        "runtime": "dist",
        "data_parallel": 2,
        "shard": "fsdp",
        "correction": "predict",
    },
]


@pytest.mark.parametrize("options", REFUSALS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_refusal_reads_the_same_from_the_command_line_and_from_python(options):
    """Each rule is written once (a registry entry or a spec): TrainConfig and Pipeline raise
    the same text for the same options."""
    from torch import nn

    import nobubble

    with pytest.raises(ValueError) as from_cli:
        TrainConfig.of(num_ranks=3, **options)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    with pytest.raises(ValueError) as from_api:
        nobubble.Pipeline(list(model), nn.functional.mse_loss, **options)
    assert str(from_cli.value) in str(from_api.value)
