"""The planner's flags, shared by ``kervan up --planner`` and the standalone planner
(``python -m control_plane.planner``), and the policy they build."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import click

from control_plane.plan.hardware import CATALOG
from control_plane.planner.predictor import PREDICTORS

if TYPE_CHECKING:
    from control_plane.planner.policy import PlannerConfig, Policy

OPTIONS = [
    click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True), default=2000.0, show_default=True,
                 help="planner: the time-to-first-token target (mean) it sizes the prefill pool for"),
    click.option("--slo-itl-ms", type=click.FloatRange(min=0, min_open=True), default=100.0, show_default=True,
                 help="planner: the inter-token latency target (mean) it sizes the decode pool for"),
    click.option("--max-prefill", type=click.IntRange(min=0), default=4, show_default=True,
                 help="planner: the most prefill workers"),
    click.option("--max-decode", type=click.IntRange(min=1), default=4, show_default=True,
                 help="planner: the most decode workers"),
    click.option("--planner-interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                 help="planner: seconds between decisions"),
    click.option("--planner-cooldown", type=click.FloatRange(min=0), default=60.0, show_default=True,
                 help="planner: a pool shrinks (by one worker an interval) only to the most it needed over this "
                      "many seconds"),
    click.option("--planner-predictor", type=click.Choice(sorted(PREDICTORS)), default="constant", show_default=True,
                 help="planner: the next interval's request rate is the last one's (constant), the line "
                      "through the last four (trend) or their mean (average)"),
    click.option("--planner-profile", default=None, type=click.Path(exists=True, dir_okay=False),
                 help="planner: step times from `kervan profile` (default: the roofline of --planner-hardware)"),
    click.option("--planner-hardware", default="this-core", show_default=True,
                 help=f"planner: a worker's device: this, this-core or one of {', '.join(CATALOG)}"),
]


def planner_options(fn):
    return functools.reduce(lambda f, option: option(f), reversed(OPTIONS), fn)


def planner_config(min_prefill: int, min_decode: int, opts: dict) -> PlannerConfig:
    from control_plane.plan.sizing import Slo
    from control_plane.planner.policy import PlannerConfig
    try:
        return PlannerConfig(Slo(opts["slo_ttft_ms"] / 1e3, opts["slo_itl_ms"] / 1e3), min_prefill=min_prefill,
                             max_prefill=max(min_prefill, opts["max_prefill"]), min_decode=min_decode,
                             max_decode=max(min_decode, opts["max_decode"]), interval_s=opts["planner_interval"],
                             scale_up_cooldown_s=opts["planner_interval"],
                             scale_down_cooldown_s=opts["planner_cooldown"], predictor=opts["planner_predictor"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def build_policy(model: str, config: PlannerConfig, hardware: str = "this-core", profile_path: str | None = None,
                 dtype: str | None = None) -> Policy:
    """The policy for ``model`` (a directory or catalog name) on ``hardware``, with the
    profile's step times when there is one."""
    from control_plane.plan.hardware import get_hardware
    from control_plane.plan.model_dir import model_shape
    from control_plane.plan.profile import Profile
    from control_plane.plan.sizing import Sizer
    from control_plane.planner.policy import Policy

    shape, weights, float_dtype = model_shape(model)
    profile = Profile.load(profile_path) if profile_path else None
    try:
        hw = get_hardware(hardware)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return Policy(Sizer(shape, weights, dtype or (profile.dtype if profile else float_dtype), hw, profile=profile),
                  config)
