"""The calibration format: measured per-microbatch costs the event engine and the projection read.

`tools/calibrate_stage.py` writes it (`megatron.studies.calibration` measures a real stage;
`profile_entry` and `calibration_document` here build the object), `tools/simulate_pipeline.py`
and `tools/project_paper_scale.py` read it (`stage_costs_from_calibration`).

The format::

    {
      "format": "pipeline-calibration", "version": 1,          (optional)
      "model": {"num_layers": 24, "hidden_size": 1024, ...},   (optional, informational)
      "device": "cpu",                                         (optional, informational)
      "p2p_s": 0.0002,                                         (optional: p2p latency, s)
      "profiles": [                                            (one per micro-batch size)
        {
          "micro_batch_size": 4,
          "layer": {"forward_s": 0.010, "backward_s": 0.020},  (a uniform transformer layer)
          "num_layers": 24,
          "embedding": {"forward_s": 0.001, "backward_s": 0.002},   (optional: first stage)
          "output": {"forward_s": 0.004, "backward_s": 0.008}       (optional: last stage,
        }                                                            output layer and loss)
      ]
    }

A profile gives its costs in one of three forms: ``"stages"``, a list with one cost entry per
pipeline stage (it must match the number of stages); ``"layers"``, a list with one entry per layer; or
``"layer"`` with ``"num_layers"`` (identical layers). Layers are split into that many equal
contiguous blocks (the layer count must divide evenly), as Megatron does by default. A cost
entry is ``{"forward_s": F, "backward_s": B, "weight_grad_s": W, "step_s": S}``, seconds per
microbatch of the profile's size (W and S optional, default 0; give W only when B is the
input-gradient part alone). A profile may carry its own ``"p2p_s"``. Without ``"profiles"``
the top-level object is the single profile. The reader picks the profile by micro-batch size
when there are several.

A writer separates the costs of a stage into parts by differences of measured stages
(`decompose`): a layer, the embedding (first stage) and the output layer with the loss (last
stage), plus a per-stage overhead that is reported, not used.
"""

import json
import math
from dataclasses import dataclass

from megatron.pipeline.simulation.costs import StageCosts

FORMAT, VERSION = "pipeline-calibration", 1
MEASURED_STAGES = ("middle_d1", "middle_d2", "first", "last")


# ----------------------------------------------------------------------------- reading
def read_calibration(path: str) -> dict:
    """The JSON object in `path`; ValueError (with the path) if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read calibration {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration {path} is not valid JSON: {e}") from None


def load_stage_costs(path: str, num_stages: int, micro_batch_size: int | None) -> StageCosts:
    """Per-stage costs from the calibration file `path`; ValueError naming the file."""
    data = read_calibration(path)
    try:
        return stage_costs_from_calibration(data, num_stages, micro_batch_size, source=path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def profile_sizes(data) -> list | None:
    """The micro-batch sizes of a calibration's profiles (None: a single unnamed profile)."""
    profiles = data.get("profiles") if isinstance(data, dict) else None
    if not isinstance(profiles, list):
        return None
    return [p.get("micro_batch_size") for p in profiles if isinstance(p, dict)]


_COST_KEYS = ("forward_s", "backward_s", "weight_grad_s", "step_s")


def _cost_entry(entry, where: str) -> tuple[float, float, float, float]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with forward_s and backward_s")
    unknown = sorted(set(entry) - set(_COST_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {list(_COST_KEYS)})")
    values = []
    for key in _COST_KEYS:
        if key not in entry and key in ("forward_s", "backward_s"):
            raise ValueError(f"{where}: missing {key}")
        value = entry.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}.{key}: expected a number of seconds, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
        values.append(float(value))
    return tuple(values)


def _select_profile(data, micro_batch_size: int | None) -> tuple[dict, str]:
    if not isinstance(data, dict):
        raise ValueError("calibration: expected a JSON object")
    if "profiles" not in data:
        return data, "calibration"
    profiles = data["profiles"]
    if not isinstance(profiles, list) or not profiles:
        raise ValueError("calibration.profiles: expected a non-empty list")
    if micro_batch_size is None:
        if len(profiles) == 1:
            return profiles[0], "calibration.profiles[0]"
        sizes = [p.get("micro_batch_size") for p in profiles if isinstance(p, dict)]
        raise ValueError(f"calibration has profiles for micro-batch sizes {sizes}: choose one")
    for i, profile in enumerate(profiles):
        if isinstance(profile, dict) and profile.get("micro_batch_size") == micro_batch_size:
            return profile, f"calibration.profiles[{i}]"
    raise ValueError(f"calibration has no profile for micro-batch size {micro_batch_size}")


def _layer_costs(profile: dict, where: str) -> list[tuple[float, float, float, float]]:
    if "layers" in profile:
        layers = profile["layers"]
        if not isinstance(layers, list) or not layers:
            raise ValueError(f"{where}.layers: expected a non-empty list")
        return [_cost_entry(e, f"{where}.layers[{i}]") for i, e in enumerate(layers)]
    count = profile.get("num_layers")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{where}: 'layer' needs 'num_layers', a positive integer")
    return [_cost_entry(profile["layer"], f"{where}.layer")] * count


def stage_costs_from_calibration(
    data: dict, num_stages: int, micro_batch_size: int | None = None, *, source: str = ""
) -> StageCosts:
    """Per-stage costs from a calibration object (the format above).

    A profile gives either ``stages`` (one cost entry per pipeline stage) or per-layer costs
    (``layers``: one entry per layer, or ``layer`` + ``num_layers``), which are split into
    equal contiguous blocks, plus optional ``embedding`` (added to the first stage) and
    ``output`` (output layer and loss, added to the last). A cost entry has ``forward_s``,
    ``backward_s`` and optional ``weight_grad_s`` and ``step_s``. ``profiles`` holds one
    profile per micro-batch size. Raises ValueError naming the offending field.
    """
    profile, where = _select_profile(data, micro_batch_size)
    if not isinstance(profile, dict):
        raise ValueError(f"{where}: expected an object")
    forms = [key for key in ("stages", "layers", "layer") if key in profile]
    if len(forms) != 1:
        raise ValueError(f"{where}: give exactly one of 'stages', 'layers' or 'layer'")
    if forms[0] == "stages":
        stages = profile["stages"]
        if not isinstance(stages, list) or len(stages) != num_stages:
            got = len(stages) if isinstance(stages, list) else stages
            raise ValueError(f"{where}.stages: {got} entries for {num_stages} stages")
        per_stage = [list(_cost_entry(e, f"{where}.stages[{i}]")) for i, e in enumerate(stages)]
    else:
        layers = _layer_costs(profile, where)
        if len(layers) % num_stages:
            raise ValueError(
                f"{where}: {len(layers)} layers do not split evenly into {num_stages} stages"
            )
        size = len(layers) // num_stages
        per_stage = [
            [sum(values) for values in zip(*layers[s * size : (s + 1) * size])]
            for s in range(num_stages)
        ]
    for key, stage in (("embedding", 0), ("output", num_stages - 1)):
        if key in profile:
            extra = _cost_entry(profile[key], f"{where}.{key}")
            per_stage[stage] = [a + b for a, b in zip(per_stage[stage], extra)]
    latency = profile.get("p2p_s", data.get("p2p_s"))
    if latency is not None and (
        isinstance(latency, bool)
        or not isinstance(latency, (int, float))
        or not math.isfinite(latency)
        or latency < 0
    ):
        raise ValueError(f"{where}.p2p_s: expected a finite number >= 0, got {latency!r}")
    columns = [list(c) for c in zip(*per_stage)]
    return StageCosts(
        *columns, p2p_latency=None if latency is None else float(latency), source=source
    )


# ----------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class PassCost:
    """Seconds for one microbatch's forward and backward through one part (a layer, the
    embedding, ...), and for that part's share of an optimizer step: a cost entry."""

    forward_s: float
    backward_s: float
    step_s: float = 0.0

    def __sub__(self, other: "PassCost") -> "PassCost":
        return PassCost(*(a - b for a, b in zip(self.values(), other.values())))

    def __add__(self, other: "PassCost") -> "PassCost":
        return PassCost(*(a + b for a, b in zip(self.values(), other.values())))

    def scaled(self, factor: float) -> "PassCost":
        return PassCost(*(v * factor for v in self.values()))

    def values(self) -> tuple[float, float, float]:
        return (self.forward_s, self.backward_s, self.step_s)

    def clamped(self, name: str, notes: list[str]) -> "PassCost":
        """Negative parts (timing noise) -> 0, each noted in `notes`."""
        fixed = []
        for field, value in zip(("forward_s", "backward_s", "step_s"), self.values()):
            if value < 0:
                notes.append(f"{name}.{field} = {value:.3g} s clamped to 0")
                value = 0.0
            fixed.append(value)
        return PassCost(*fixed)

    def entry(self, with_step: bool) -> dict:
        """A cost entry of the calibration format."""
        entry = {"forward_s": self.forward_s, "backward_s": self.backward_s}
        if with_step:
            entry["step_s"] = self.step_s
        return entry


def decompose(
    measured: dict[str, PassCost], depths: list[int]
) -> tuple[dict[str, PassCost], list[str]]:
    """Per-layer, embedding, output and per-stage overhead costs from the four stage timings
    (`MEASURED_STAGES`); the second value lists the differences clamped to 0.

        layer     = (middle(d2) - middle(d1)) / (d2 - d1)
        embedding = first(d1) - middle(d1)
        output    = last(d1) - middle(d1)          (final norm, output layer and loss)
        overhead  = middle(d1) - d1 * layer        (per stage, not per layer)
    """
    d1, d2 = depths[0], depths[-1]
    notes: list[str] = []
    mid1 = measured["middle_d1"]
    if d2 > d1:
        layer = (measured["middle_d2"] - mid1).scaled(1.0 / (d2 - d1)).clamped("layer", notes)
        overhead = mid1 - layer.scaled(d1)
    else:
        layer, overhead = mid1.scaled(1.0 / d1), PassCost(0.0, 0.0, 0.0)
    parts = {
        "layer": layer,
        "embedding": (measured["first"] - mid1).clamped("embedding", notes),
        "output": (measured["last"] - mid1).clamped("output", notes),
        "stage_overhead": overhead,
    }
    return parts, notes


def predicted_whole_model(parts: dict[str, PassCost], num_layers: int) -> PassCost:
    """The one-stage model as the parts add up: embedding + L layers + output + overhead."""
    return (
        parts["embedding"]
        + parts["layer"].scaled(num_layers)
        + parts["output"]
        + parts["stage_overhead"]
    )


def profile_entry(
    micro_batch_size: int,
    parts: dict[str, PassCost],
    num_layers: int,
    *,
    with_step: bool,
    p2p_s: float | None = None,
) -> dict:
    """One profile in the ``layer`` + ``num_layers`` form with embedding and output."""
    profile = {
        "micro_batch_size": micro_batch_size,
        "layer": parts["layer"].entry(with_step),
        "num_layers": num_layers,
        "embedding": parts["embedding"].entry(with_step),
        "output": parts["output"].entry(with_step),
    }
    if p2p_s is not None:
        profile["p2p_s"] = p2p_s
    return profile


def calibration_document(
    *,
    model: dict,
    device_type: str,
    profiles: list[dict],
    metadata: dict,
    p2p_s: float | None = None,
) -> dict:
    """The calibration object (+ `metadata`)."""
    document = {"format": FORMAT, "version": VERSION, "model": model, "device": device_type}
    if p2p_s is not None:
        document["p2p_s"] = p2p_s
    document["profiles"] = profiles
    document["metadata"] = metadata
    return document
