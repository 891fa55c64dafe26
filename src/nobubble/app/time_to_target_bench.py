"""``nobubble bench time-to-target`` as one library call: ``run_race(RaceConfig(...))``.

The race's settings are the demo's (mini, Muon, P=2 on two processes, M=4) with the caller's
``nobubble train`` flags after them; the race includes every synchronous schedule the runtime
trains there. It optionally tunes every contestant's lr first, checks the projected clock
against the measured one (P=2), carries a checked race's error bars onto a projected race
(P >= 4), trains an equal-budget race after the equal-steps one, and draws the loss against the
training clock (``loss-vs-time-P{P}.png`` in the race's folder).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nobubble.app.time_to_target import (
    BASELINE,
    Variant,
    dir_name,
    error_bar,
    parse_variants,
    train_config,
    transfer_seconds,
)
from nobubble.app.time_to_target_race import (
    EMULATED,
    RaceOptions,
    against,
    equal_budget,
    race,
    summarize,
    sync_contestants,
)
from nobubble.app.time_to_target_report import plot_curves
from nobubble.app.time_to_target_tune import Tune


@dataclass(frozen=True)
class RaceConfig:
    """A race as ``nobubble bench time-to-target`` spells it (see its --help).

    projection_from: a checked race's JSON whose projection errors become this (projected)
    race's error bars; transfers: charge each hop the send cost measured there; lean_budget:
    see ``RaceOptions``.
    """

    variants: str = "1f1b,paci,2bw"
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 150
    rounds: int = 3
    eval_every: int = 0  # 0: a fifth of a round
    train: tuple[str, ...] = ()
    equal_budget: bool = False
    sync: bool = True  # race every synchronous schedule the runtime trains at this P and M
    check_projection: bool = False
    projection_from: Path | None = None
    transfers: bool = False
    tune: Tune | None = None
    lean_budget: bool = False
    out: Path = field(default_factory=lambda: Path("runs/time-to-target"))
    progress: bool = True


def base_flags(cfg: RaceConfig) -> tuple[list[str], int]:
    """The runs' ``nobubble train`` flags (the demo's, then the caller's) and the evaluation
    interval, refused where evaluations would miss the rounds' drain points."""
    from nobubble.app.demo import demo_flags, eval_every

    every = cfg.eval_every or eval_every(cfg.steps, cfg.rounds)
    if (cfg.steps // cfg.rounds) % every:
        raise ValueError(
            f"--eval-every {every} does not divide a round of {cfg.steps // cfg.rounds} steps: "
            "evaluations must fall on the rounds' drain points too"
        )
    return [*demo_flags(cfg.steps, cfg.rounds), "--eval-every", str(every), *cfg.train], every


def load_check(path: Path) -> dict[str, Any]:
    """The ``projection_check`` of a race run with ``--check-projection`` (its JSON at ``path``)."""
    saved = json.loads(Path(path).read_text())
    check = saved.get("projection_check") or saved.get("equal_steps", {}).get("projection_check")
    if check is None:
        raise ValueError(
            f"--projection-from {path} holds no projection check: give the JSON of a race run "
            "with --check-projection"
        )
    return dict(check)


def options(cfg: RaceConfig, runtime: str) -> RaceOptions:
    """The race's options, refused where they cannot work, before any run starts."""
    if cfg.check_projection and runtime != "dist":
        raise ValueError(
            "--check-projection compares the projected clock with a measured one: give "
            "--runtime dist (the default), not --runtime emulate"
        )
    if cfg.transfers and cfg.projection_from is None:
        raise ValueError(
            "--transfers uses a checked race's measured send cost: give --projection-from FILE"
        )
    check = None if cfg.projection_from is None else load_check(cfg.projection_from)
    transfer_s = check["transfer_s"] if check is not None and cfg.transfers else 0.0
    if cfg.lean_budget and not cfg.equal_budget:
        raise ValueError("--lean-budget shapes the equal-budget race: give --equal-budget too")
    return RaceOptions(cfg.check_projection, transfer_s, check, cfg.tune, None, cfg.lean_budget)


def run_race(cfg: RaceConfig) -> dict[str, Any]:
    """Train the race (and the equal-budget one), check the projection, draw the curves."""
    base, every = base_flags(cfg)
    train = train_config(base)
    names, skipped = sync_contestants(base) if cfg.sync else ([], {})
    variants = parse_variants(cfg.variants, names)
    opts = options(cfg, train.runtime.runtime)
    out, seeds = Path(cfg.out), list(cfg.seeds)
    if cfg.equal_budget:
        quantum = cfg.rounds * every  # whole rounds of whole evaluation intervals
        args = (out, base, variants, seeds, cfg.steps, cfg.rounds, quantum, cfg.progress, opts)
        result = equal_budget(*args)
        races = {"equal steps": result["equal_steps"], "equal budget": result["equal_budget"]}
    else:
        result = race(out, base, variants, seeds, cfg.steps, cfg.rounds, cfg.progress, opts)
        races = {"equal steps": result}
    first = races["equal steps"]
    if cfg.check_projection:
        first["projection_check"] = check_projection(out, variants, seeds, first)
    p, m = train.num_ranks, train.schedule.microbatches
    title = f"P={p}, M={m}, {train.optimizer.optimizer}, seeds {seeds}"
    figure = plot_curves(races, title, out / f"loss-vs-time-P{train.num_ranks}.png")
    for one in races.values():
        one |= {
            "stages": train.num_ranks,
            "microbatches": train.schedule.microbatches,
            "optimizer": train.optimizer.optimizer,
            "skipped": skipped,
        }
        one["figure"] = str(figure)
    return result


def _errors(measured: Mapping[str, Any], projected: Mapping[str, Any]) -> dict[str, Any]:
    """Per variant: the projected over the measured training time, and over the measured ratio
    of it to the best synchronous schedule's and 1f1b's (medians over seeds), less 1."""
    out = {}
    for label, row in measured["variants"].items():
        twin = projected["variants"][label]["seeds"]
        errors: dict[str, list[float]] = {"time": [], "vs_best": [], "vs_1f1b": []}
        for s, r in row["seeds"].items():
            p = twin[s]
            errors["time"].append(p["train_s"] / r["train_s"] - 1)
            for name, base in (("vs_best", measured["baseline"]), ("vs_1f1b", BASELINE)):
                m_ratio = r["train_s"] / measured["variants"][base]["seeds"][s]["train_s"]
                p_ratio = p["train_s"] / projected["variants"][base]["seeds"][s]["train_s"]
                errors[name].append(p_ratio / m_ratio - 1)
        out[label] = {k: statistics.median(v) for k, v in errors.items()}
    return out


def check_projection(
    out: Path, variants: Sequence[Variant], seeds: Sequence[int], measured: Mapping[str, Any]
) -> dict[str, Any]:
    """The projection against the measured clock of the same runs: the losses must agree, and
    each variant's error with transfers free and with the measured send cost per hop."""
    transfer = statistics.median(
        transfer_seconds(out / f"seed{s}" / dir_name(v.label)) for s in seeds for v in variants
    )
    free = summarize(out, variants, seeds, RaceOptions(), under=EMULATED)
    paid = summarize(out, variants, seeds, RaceOptions(transfer_s=transfer), under=EMULATED)
    gap = max(
        abs(free["variants"][v.label]["seeds"][s]["final_val"] - r["final_val"])
        for v in variants
        for s, r in measured["variants"][v.label]["seeds"].items()
    )
    return {
        "loss_difference": gap,  # 0: the emulated runs are the measured ones, loss for loss
        "transfer_s": transfer,
        "free": _errors(measured, free),
        "with_transfers": _errors(measured, paid),
    }


# ----- a saved race, read back -------------------------------------------------------------------
def _races_of(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "equal_budget" in result:
        return [result["equal_steps"], result["equal_budget"]]
    return [dict(result)]


def load_race(path: Path, projection_from: Path | None = None) -> dict[str, Any]:
    """A race's ``--json`` output read back; with ``projection_from`` (a checked race's JSON,
    as ``--projection-from``) every projected row gets that check's error bar, so a race run
    before its check was measured carries the bars without training again."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--show {path}: not a race's JSON ({err})") from None
    if "equal_steps" not in result and "variants" not in result:
        raise ValueError(f"--show {path}: no race in it: give a `time-to-target --json` output")
    if any("clock" not in row for one in _races_of(result) for row in one["variants"].values()):
        raise ValueError(
            f"--show {path}: a race of the older format (no clock per row, before issue 44); "
            "print it with the code that wrote it, or run the race again"
        )
    for one in _races_of(result):  # JSON keeps the seeds' keys as strings
        for row in one["variants"].values():
            row["seeds"] = {int(k): v for k, v in row["seeds"].items()}
    if projection_from is not None:
        check = load_check(projection_from)
        for one in _races_of(result):
            for label, row in one["variants"].items():
                if row["clock"] == "projected":
                    variant = Variant.parse(label)
                    row["error_bar"] = error_bar(check, variant, one.get("transfer_s", 0.0))
    return result


def rebase(result: Mapping[str, Any], label: str) -> dict[str, Any]:
    """A loaded race (``load_race``) with every ratio against ``label``'s equal-steps run
    (``time_to_target_race.against``): the equal-budget race's variants too, against the same
    reference run, so "reached" means within the best synchronous schedule's budget."""
    if "equal_budget" not in result:
        return against(result, result, label)
    same = against(result["equal_steps"], result["equal_steps"], label)
    budget = against(result["equal_budget"], result["equal_steps"], label)
    return {**result, "equal_steps": same, "equal_budget": budget}


def verdict_rows(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per saved race and variant: its (P, M, optimizer), the best synchronous
    schedule, and the variant's time to that schedule's final loss as a ratio of the
    schedule's own time (median over the seeds that reached it, k/n), at equal steps and at
    equal budget. The tables of docs/benchmarks.md's depth study."""
    rows = []
    for name, result in results.items():
        races = _races_of(result)
        first = races[0]
        for label in first["variants"]:
            out: dict[str, Any] = {"race": name, "variant": label}
            out |= {k: first.get(k) for k in ("stages", "microbatches", "baseline")}
            out["best_sync"] = first.get("best_synchronous", {}).get("best", out["baseline"])
            out["optimizer"] = first.get("optimizer", "?")  # races before it was recorded: ?
            for title, one in zip(("steps", "budget"), races, strict=False):
                if label not in one["variants"]:  # a lean budget left it out
                    continue
                r = one["variants"][label]
                out[f"{title}_median"] = r["vs_best_median"]
                out[f"{title}_reached"] = r["vs_best_reached"]
                out[f"{title}_interval"] = r["vs_best_interval"]
                out[f"{title}_final"] = r["final_val_mean"]
                out[f"{title}_bar"] = (r.get("error_bar") or {}).get("vs_best")
                out["clock"] = r["clock"]
            rows.append(out)
    return rows
