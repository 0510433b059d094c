"""Pipeline timelines in Chrome's trace-event format, shared by the simulator and the runtime.

A timeline is a list of `TraceEvent`s: which stage ran which schedule `Action`, from when to
when (seconds). `write_chrome_trace` stores it as a JSON file that Perfetto
(https://ui.perfetto.dev) and chrome://tracing open directly: one process (pid 0) with one
track per pipeline stage (tid = stage, named "stage i"), one complete event ("ph": "X") per
action, named like the action ("F3", "B3", "W3", "S"; "F3c1" for chunk 1 of a rank with
virtual stages, the track then being the rank), with the action kind as its category and
`ts`/`dur` in microseconds as the format requires.

Because the simulator and the runtime write the same format, a real run and its simulation
can be opened side by side, and `action_order` reduces either to the per-stage sequence of
actions so a test can compare them.
"""

import json
import os
from dataclasses import dataclass
from typing import Iterable

from .schedules.base import KIND_INFO, Action, ActionKind

_US_PER_S = 1e6
_NOT_WORK = tuple(kind for kind, info in KIND_INFO.items() if not info.runs)


@dataclass(frozen=True)
class TraceEvent:
    """One action of one stage: `stage` ran `action` from `start_s` to `end_s` (seconds)."""

    stage: int
    action: Action
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class SpanEvent:
    """Something that ran beside a stage's actions (a data-parallel reduction in flight, the
    step waiting for one): drawn on the stage's second track, `SPAN_TRACK` + stage."""

    stage: int
    name: str
    start_s: float
    end_s: float


SPAN_TRACK = 1000


def _span_record(span: SpanEvent, pid: int) -> dict:
    return {
        "name": span.name,
        "cat": "communication",
        "ph": "X",
        "pid": pid,
        "tid": SPAN_TRACK + span.stage,
        "ts": span.start_s * _US_PER_S,
        "dur": max(span.end_s - span.start_s, 0.0) * _US_PER_S,
    }


def _event_record(event: TraceEvent, pid: int) -> dict:
    action = event.action
    args = {"kind": action.kind.value}
    if action.microbatch is not None:
        args["microbatch"] = action.microbatch
    if action.chunk is not None:
        args["chunk"] = action.chunk
    if action.together:
        args["together"] = [str(part) for part in action.together]
    return {
        "name": str(action),
        "cat": action.kind.name.lower(),
        "ph": "X",
        "pid": pid,
        "tid": event.stage,
        "ts": event.start_s * _US_PER_S,
        "dur": max(event.end_s - event.start_s, 0.0) * _US_PER_S,
        "args": args,
    }


def _metadata_records(stages: Iterable[int], process_name: str, pid: int) -> list[dict]:
    records = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}]
    for stage in sorted(stages):
        track = {"ph": "M", "pid": pid, "tid": stage}
        records.append({"name": "thread_name", **track, "args": {"name": f"stage {stage}"}})
        records.append({"name": "thread_sort_index", **track, "args": {"sort_index": stage}})
    return records


def chrome_trace(events: Iterable[TraceEvent], *, process_name: str = "pipeline",
                 spans: Iterable[SpanEvent] = ()) -> dict:  # fmt: skip
    """The trace as a JSON-ready object (``{"traceEvents": [...], "displayTimeUnit": "ms"}``);
    `spans` on a second track per stage ("stage i: data-parallel reduction")."""
    events, spans = list(events), list(spans)
    pid = 0
    records = _metadata_records({e.stage for e in events}, process_name, pid)
    for stage in sorted({span.stage for span in spans}):
        track = {"ph": "M", "pid": pid, "tid": SPAN_TRACK + stage}
        name = f"stage {stage}: data-parallel reduction"
        records.append({"name": "thread_name", **track, "args": {"name": name}})
        records.append({"name": "thread_sort_index", **track, "args": {"sort_index": stage}})
    records.extend(_event_record(e, pid) for e in sorted(events, key=lambda e: e.start_s))
    records.extend(_span_record(s, pid) for s in sorted(spans, key=lambda s: s.start_s))
    return {"traceEvents": records, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str,
    events: Iterable[TraceEvent],
    *,
    process_name: str = "pipeline",
    spans: Iterable[SpanEvent] = (),
) -> None:
    """Write `events` (and `spans`) to `path` as a Chrome trace (written to a temporary file,
    then renamed)."""
    trace = chrome_trace(events, process_name=process_name, spans=spans)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(trace, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _parse_action(record: dict) -> Action:
    args = record.get("args") or {}
    if "kind" in args:
        together = tuple(_parse_name(name) for name in args.get("together", ()))
        kind, microbatch = ActionKind(args["kind"]), args.get("microbatch")
        return Action(kind, microbatch, args.get("chunk"), together)
    # a trace written by another tool: "F3", "B3", "F3c1", "F3c0&B1c1", "S", ...
    first, *rest = str(record["name"]).split("&")
    head = _parse_name(first)
    return Action(head.kind, head.microbatch, head.chunk, tuple(map(_parse_name, rest)))


def _parse_name(name: str) -> Action:
    for kind in sorted(ActionKind, key=lambda k: -len(k.value)):
        if name.startswith(kind.value):
            rest = name[len(kind.value) :]
            if rest == "":
                return Action(kind)
            if rest.isdigit():
                return Action(kind, int(rest))
            microbatch, _, chunk = rest.partition("c")
            if microbatch.isdigit() and chunk.isdigit():
                return Action(kind, int(microbatch), int(chunk))
    raise ValueError(f"trace event name {name!r} is not a pipeline action")


def read_chrome_trace(path: str) -> list[TraceEvent]:
    """Read back the complete events of a Chrome trace written by `write_chrome_trace`.

    Accepts both the object form (``{"traceEvents": [...]}``) and the bare-array form of the
    format. Metadata and other non-"X" events are skipped; times are converted to seconds.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    records = data.get("traceEvents", []) if isinstance(data, dict) else data
    events = []
    for record in records:
        if not isinstance(record, dict) or record.get("ph") != "X":
            continue
        start = float(record["ts"]) / _US_PER_S
        end = start + float(record.get("dur", 0.0)) / _US_PER_S
        events.append(TraceEvent(int(record["tid"]), _parse_action(record), start, end))
    return events


def action_order(events: Iterable[TraceEvent]) -> dict[int, list[str]]:
    """Per stage, the names of its actions ("F0", "B0", "S", ...) in order of start time.

    WAIT and DONE are left out: they are decisions, not work. Events with equal start times
    keep the order they were given in.
    """
    order: dict[int, list[tuple[float, int, str]]] = {}
    for index, event in enumerate(events):
        if event.action.kind in _NOT_WORK:
            continue
        order.setdefault(event.stage, []).append((event.start_s, index, str(event.action)))
    return {stage: [name for _, _, name in sorted(items)] for stage, items in sorted(order.items())}
