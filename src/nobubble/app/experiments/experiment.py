"""``nobubble experiment NAME``: one experiment's grids run (resumable), summarized and tabled."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nobubble.app.experiments import (
    analysis,
    depth_analysis,
    depth_verdict_analysis,
    gap_analysis,
    grids,
    grids_depth,
    paci_analysis,
)
from nobubble.app.experiments.runner import RunOutcome, RunSpec, run_grid
from nobubble.app.experiments.stats import MIN_SEEDS
from nobubble.optim.library import check_installed

log = logging.getLogger(__name__)

EXPERIMENTS = (
    "delay-vs-optimizer",
    "error-feedback",
    "depth",
    "paci",
    "lr-gap",
    "corrections",
    "depth-verdict",
    "report",
)
GRIDS = {
    "delay-vs-optimizer": grids.delay_vs_optimizer,
    "error-feedback": grids.error_feedback,
    "depth": grids.depth,
    "paci": grids.paci,
    "lr-gap": grids.lr_gap,
    "corrections": grids.corrections,
    "depth-verdict": grids_depth.depth_verdict,
}
TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "delay-vs-optimizer": analysis.delay_table,
    "error-feedback": analysis.ef_table,
    "depth": depth_analysis.depth_table,
    "paci": paci_analysis.paci_table,
    "lr-gap": gap_analysis.gap_table,
    "corrections": gap_analysis.gap_table,
    "depth-verdict": depth_verdict_analysis.depth_verdict_table,
}
# a run's estimated training seconds, for --dry-run (a grid without one lists its runs only)
ESTIMATES = {"depth-verdict": grids_depth.depth_verdict_seconds}


def default_root(quick: bool) -> Path:
    return Path("runs") / ("experiments-quick" if quick else "experiments")


def summary_folder(name: str, profile: grids.Profile) -> str:
    """Where an experiment's summary goes under the root: the longer regime's beside the short
    one's (``error-feedback-long``); both regimes share the root's runs folder (keys differ)."""
    for regime in ("long", "depth"):  # the depth regime's sweep is its own too
        if profile.name.endswith(regime):
            return f"{name}-{regime}"
    return name


def tuned_lrs(profile: grids.Profile, root: Path, jobs: int, progress: bool) -> dict[str, float]:
    """Best synchronous lr per optimizer (final validation loss), shared by all experiments."""
    out = root / summary_folder("lr-sweep", profile)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = run_grid(
        grids.lr_sweep(profile), profile.base, root / "runs", jobs, progress, "lr sweep"
    )
    best: dict[str, float] = {}
    table = {}
    for opt in profile.optimizers:
        runs = analysis.select(outcomes, optimizer=opt)
        scores = {o.spec.labels["lr"]: analysis.final_val(o) for o in runs}
        best[opt] = min(scores, key=lambda lr: scores[lr])
        table[opt] = {str(k): v for k, v in sorted(scores.items())}
        grid = profile.lr_grid[opt]
        if grids.on_grid_edge(best[opt], grid):
            log.warning(
                "%s: the best lr %g is on the edge of its grid %s; extend the grid",
                opt,
                best[opt],
                grid,
            )
    (out / "lr.json").write_text(json.dumps({"best": best, "val_loss": table}, indent=1) + "\n")
    return best


def run_experiment(
    name: str,
    quick: bool,
    seeds: int | None,
    out: str | None,
    jobs: int,
    progress: bool = True,
    report_to: str = "docs/results.md",
    depths: tuple[int, ...] | None = None,
    regime: str = "short",
    optimizers: tuple[str, ...] | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Run experiment ``name``'s grid under ``out`` (tuning the learning rates first, reusing
    finished runs) and write its summary, or for ``report`` write ``report_to`` from the
    summaries there; every argument is checked before any run. ``dry_run``: list the runs
    (the sweep's included) and their estimated training time, and run nothing."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    profile = grids.profile_for(regime, quick)
    if name != "report" and name not in profile.experiments:
        owners = [r for r, p in grids.PROFILES.items() if name in p[False].experiments]
        raise ValueError(
            f"--regime {regime} defines {', '.join(profile.experiments)}, not {name}: "
            f"run it with --regime {owners[0]}"
        )
    if seeds is not None and seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    root = Path(out) if out else default_root(quick)
    if name == "report":
        if optimizers is not None:
            raise ValueError("--optimizers is an option of the experiments, not of report")
        from nobubble.app.experiments.report import write_report

        return write_report(root, Path(report_to))
    profile, sweep_profile, seeds = _narrowed(name, profile, quick, seeds, depths, optimizers)
    left_out = _left_out(name, profile, sweep_profile, seeds, optimizers)
    if dry_run:
        return dry_run_listing(name, profile, sweep_profile, seeds)
    lrs = tuned_lrs(sweep_profile, root, jobs, progress)
    exp_dir = root / summary_folder(name, profile)
    exp_dir.mkdir(parents=True, exist_ok=True)
    outcomes = run_grid(
        GRIDS[name](profile, lrs, seeds), profile.base, root / "runs", jobs, progress, name
    )
    summary = summarize(name, outcomes, exp_dir, profile, lrs)
    summary.update(
        experiment=name,
        profile=profile.name,
        seeds=seeds,
        lrs=lrs,
        base=profile.base,
        runs=len(outcomes),
        depths=list(profile.depths) if name in ("depth", "depth-verdict") else None,
        optimizers_run=list(profile.optimizers),
        left_out=left_out,
        params=_params(outcomes),
    )
    summary["folder"] = str(exp_dir)
    analysis.write_summary(exp_dir, name, summary, TABLES[name](summary))
    return summary


def _narrowed(
    name: str,
    profile: grids.Profile,
    quick: bool,
    seeds: int | None,
    depths: tuple[int, ...] | None,
    optimizers: tuple[str, ...] | None,
) -> tuple[grids.Profile, grids.Profile, int]:
    """(the profile this call runs, the one its learning-rate sweep covers, seeds): ``--optimizers``
    narrows the first only, since the sweep covers every optimizer of the regime; ``--depths``
    narrows both. Every optimizer's library is checked here, before any run."""
    sweep_profile = profile
    if optimizers is not None:
        unknown = [o for o in optimizers if o not in profile.optimizers]
        if unknown:
            raise ValueError(
                f"--optimizers {','.join(optimizers)}: {', '.join(unknown)} is not an optimizer "
                f"of the {profile.name} profile; choose among {','.join(profile.optimizers)}"
            )
        profile = dataclasses.replace(profile, optimizers=optimizers)
    for opt in sweep_profile.optimizers:  # a missing optional library fails here, before any run
        check_installed(opt)
    seeds = profile.seeds if seeds is None else seeds
    if seeds < MIN_SEEDS and not quick:  # the quick profile is a smoke test, not evidence
        log.warning(
            "--seeds %d: the report needs %d paired seeds for a verdict; with fewer every "
            "verdict of %s reads inconclusive",
            seeds,
            MIN_SEEDS,
            name,
        )
    if depths is not None:
        if name not in ("depth", "depth-verdict"):
            raise ValueError(f"--depths is an option of the depth experiment, not of {name}")
        profile = dataclasses.replace(profile, depths=depths)
        sweep_profile = dataclasses.replace(sweep_profile, depths=depths)
    return profile, sweep_profile, seeds


def _left_out(
    name: str,
    profile: grids.Profile,
    sweep_profile: grids.Profile,
    seeds: int,
    optimizers: tuple[str, ...] | None,
) -> list[str]:
    """The optimizers of experiment ``name``'s grid that ``--optimizers`` leaves out; refuses a
    choice that leaves out all of them. The grid is built once with placeholder learning rates,
    so a grid that cannot be built fails before the sweep."""
    placeholder = {o: sweep_profile.lr_grid[o][0] for o in sweep_profile.optimizers}
    grid_optimizers = [
        o
        for o in sweep_profile.optimizers
        if o in _optimizers_of(GRIDS[name](sweep_profile, placeholder, seeds))
    ]
    ran = _optimizers_of(GRIDS[name](profile, placeholder, seeds))
    left_out = [o for o in grid_optimizers if o not in ran]
    if optimizers is not None and len(left_out) == len(grid_optimizers):
        raise ValueError(
            f"--optimizers {','.join(optimizers)}: the {name} grid runs "
            f"{','.join(grid_optimizers)} only; choose among them"
        )
    return left_out


def dry_run_listing(
    name: str, profile: grids.Profile, sweep_profile: grids.Profile, seeds: int
) -> dict[str, Any]:
    """The runs experiment ``name`` would start (the sweep's first; a run two lists share once)
    and, where the grid has an estimate (``ESTIMATES``), their training seconds, one at a time.
    Learning rates are placeholders (each grid's first value): they change no run's cost."""
    placeholder = {o: sweep_profile.lr_grid[o][0] for o in sweep_profile.optimizers}
    specs = grids.lr_sweep(sweep_profile) + GRIDS[name](profile, placeholder, seeds)
    unique = list({s.name: s for s in specs}.values())
    estimate = ESTIMATES.get(name)
    seconds = [estimate(s.overrides, profile.base) if estimate else None for s in unique]
    return {
        "experiment": name,
        "profile": profile.name,
        "dry_run": True,
        "runs": [s.name for s in unique],
        "sweep_runs": len(grids.lr_sweep(sweep_profile)),
        "run_seconds": seconds,
        "cpu_seconds": sum(s for s in seconds if s is not None) if estimate else None,
    }


def _optimizers_of(specs: list[RunSpec]) -> set[str]:
    return {str(s.labels.get("optimizer")) for s in specs}


def summarize(
    name: str,
    outcomes: dict[str, RunOutcome],
    out: Path,
    profile: grids.Profile,
    lrs: dict[str, float],
) -> dict[str, Any]:
    if name == "paci":
        return paci_analysis.analyze_paci(outcomes, out, profile.optimizers, lrs, profile.base)
    if name == "depth":
        return depth_analysis.analyze_depth(outcomes, out, profile.optimizers)
    if name == "depth-verdict":
        return depth_verdict_analysis.analyze_depth_verdict(outcomes, out, profile.optimizers)
    if name in ("lr-gap", "corrections"):
        fixes = grids.GAP_CORRECTIONS if name == "corrections" else ()
        return gap_analysis.analyze_gap(outcomes, out, profile.optimizers, lrs, fixes)
    if name == "error-feedback":
        return analysis.analyze_ef(outcomes, out, profile.optimizers, lrs, profile.corrections)
    return analysis.analyze_delay(outcomes, out, profile.optimizers, lrs)


def _params(outcomes: dict[str, RunOutcome]) -> dict[str, Any]:
    """Model sizes and token budgets actually used (read from the runs' resolved configs)."""
    seen: dict[str, Any] = {}
    for o in outcomes.values():
        cfg = json.loads((o.run_dir / "config.json").read_text())
        model = cfg["config"]["model"]
        params = cfg.get("resolved", {}).get("num_params")
        if params is None:  # the multi-process runtime's config.json does not resolve it
            from nobubble.model import model_config

            c = cfg["config"]
            params = model_config(model, c["vocab_size"], c["seq_len"]).num_params()
        seen.setdefault(model, {"num_params": params, "tokens_per_run": set()})
        seen[model]["tokens_per_run"].add(o.summary["tokens"])
    return {
        k: {"num_params": v["num_params"], "tokens_per_run": sorted(v["tokens_per_run"])}
        for k, v in seen.items()
    }
