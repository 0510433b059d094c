"""The schedule registries: one small module per schedule, looked up by its CLI name.

`SCHEDULES` holds what the runtime runs, by --pipeline-schedule name: 1F1B-flush, PACI, the
weight-stashing PipeDream-2BW and PipeDream, and the split-backward zero-bubble schedules ZB-H1,
ZB-V and DualPipeV (the last two on the V placement, two model chunks per rank) and the
interleaved zero bubble (interleaved placement, v model chunks per rank, default 2).
`SIMULATED_SCHEDULES` adds GPipe, a reference only the simulator runs, and the variants with
virtual stages under their own names (interleaved 1F1B, PACI over virtual stages), which the
runtime runs when --pipeline-schedule 1f1b or paci comes with Megatron's virtual-pipeline flags
(`virtual_schedule`).
"""

from . import (
    dualpipe_v,
    flush_1f1b,
    gpipe,
    interleaved_1f1b,
    paci,
    paci_interleaved,
    pipedream,
    pipedream_2bw,
    zb_h1,
    zb_interleaved,
    zb_v,
)
from .base import Action, ActionKind, Schedule, StageView

SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        flush_1f1b.SCHEDULE,
        paci.SCHEDULE,
        pipedream_2bw.SCHEDULE,
        pipedream.SCHEDULE,
        zb_h1.SCHEDULE,
        zb_v.SCHEDULE,
        dualpipe_v.SCHEDULE,
        zb_interleaved.SCHEDULE,
    )
}

SIMULATED_SCHEDULES: dict[str, Schedule] = {
    **SCHEDULES,
    **{s.name: s for s in (gpipe.SCHEDULE, interleaved_1f1b.SCHEDULE, paci_interleaved.SCHEDULE)},
}


# Schedules the runtime runs with virtual stages: the one a --pipeline-schedule name becomes
# when the virtual-pipeline flags give several model chunks per rank (as Megatron's 1F1B
# becomes its interleaved schedule).
VIRTUAL_STAGE_SCHEDULES = ("1f1b", "paci")

# Schedules with their own placement whose model chunks per rank the virtual-pipeline flags set
# (default: `Schedule.default_chunks_per_rank`); the V schedules run exactly their two.
CHUNKS_FROM_FLAGS = ("zb-interleaved",)


def virtual_schedule(
    name: str,
    group_size: int | None = None,
    arrival_rule: str | None = None,
    inflight_limit: str | None = None,
) -> Schedule:
    """The schedule that --pipeline-schedule `name` runs with several model chunks per rank;
    `group_size`: microbatches per group (--microbatch-group-size-per-virtual-pipeline-stage,
    None: the number of ranks); PACI's options as `paci.with_paci_options` takes them.
    ValueError for a schedule without such a variant."""
    if name not in VIRTUAL_STAGE_SCHEDULES:
        raise ValueError(f"--pipeline-schedule {name} with virtual pipeline stages")
    paci.with_paci_options(get_schedule(name), arrival_rule, inflight_limit)  # errors
    if name == "paci":
        # its own default rule (forward-first); "fixed" is its counter-only order
        rule = arrival_rule or paci_interleaved.DEFAULT_ARRIVAL_RULE
        if rule not in paci_interleaved.ARRIVAL_RULES:
            raise ValueError(f"--paci-arrival-rule {rule} with virtual pipeline stages")
        return paci_interleaved.paci_interleaved(group_size, rule)
    return interleaved_1f1b.interleaved_1f1b(group_size)


def get_schedule(name: str, *, simulated: bool = False) -> Schedule:
    """The runtime's schedule `name`; with `simulated`, also the simulator-only references."""
    registry = SIMULATED_SCHEDULES if simulated else SCHEDULES
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown pipeline schedule {name!r} (known: {known})") from None


__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "StageView",
    "SCHEDULES",
    "SIMULATED_SCHEDULES",
    "CHUNKS_FROM_FLAGS",
    "get_schedule",
    "virtual_schedule",
]
