"""The paper-scale projection: pipeline throughput at the paper's scale: 1F1B-flush vs PACI (and the references).

For every (micro-batch size, microbatches per step) configuration the tool builds per-stage
costs, runs the event engine (`megatron.pipeline.simulation.engine`, the runtime's own
schedule definitions) and reports steady-state samples per second, PACI's speedup over flush at
the same configuration and over the best-tuned flush, drift, in-flight microbatches and memory.
`tools/project_paper_scale.py` is its command line (``--help`` lists every flag); `docs/projection.md` is the report these outputs make.

Where the costs come from (one of):

* a cost model (default): FLOPs of each pass from the model shape, divided by
  ``--peak-tflops`` x e(b), where e(b) is the **per-microbatch efficiency curve**: the fraction
  of peak a stage reaches at micro-batch size b. It is an explicit input (``--efficiency
  1:0.18,2:0.27,...``); the default is an *assumption*, e(b) = e_max * bs / (bs + n_half)
  (tokens per microbatch bs = b x seq; ``--efficiency-max``, ``--efficiency-half-tokens``),
  printed in the report. Per layer and microbatch of T = b x seq tokens, hidden h, FFN f:
  forward 8Th^2 + 4Thf + 2Tsh (causal attention), input-gradient backward 8Th^2 + 4Thf + 4Tsh,
  weight-gradient backward 8Th^2 + 4Thf; output layer 2ThV each; the embedding 0. Optimizer
  step: parameters x ``--optimizer-bytes-per-param`` / ``--memory-bandwidth-gbs``. Point-to-
  point: ``--p2p-latency-us`` + activation bytes (T x h x 2) / ``--p2p-bandwidth-gbs`` per hop;
* a calibration (``--calibration FILE.json``, from `tools/calibrate_stage.py` or
  `tools/gpu_check.sh`): measured per-microbatch times replace the cost model, efficiency curve
  included (the tool prints the curve the measurements imply). Read with
  `megatron.benchmarks.calibration_file.stage_costs_from_calibration` (even layer split). Its ``p2p_s`` is used unless ``--p2p-s``
  is given; without either, the p2p model above applies.

Steady state: `megatron.pipeline.simulation.results.steady_state_throughput`, the one definition
the simulator and the benchmark use too, over the window from step k to step 2k (k >= 3 and
>= 8N/m) of a run that drains after it: PACI's one-time fill and drain are left out, and
flush's steps repeat exactly. PACI runs with a = m (its step has the flush's batch).

Settings: `parse_args` resolves the flags once into a frozen `ProjectionOptions` (preset,
calibration and derived values filled in), the one settings object every function here takes.

With a link model (``--cluster gpu`` or the link flags; `run_cluster`) the projection counts
communication at cluster scale instead of one p2p time per hop: TP x PP x DP ranks in
Megatron's order on nodes of ``--ranks-per-node`` GPUs, each pipeline hop on its intra- or
inter-node link, each stage's data-parallel reduction (all-reduce, or reduce-scatter and
all-gather with ``--use-distributed-optimizer``) at the step, overlapped from the last backward,
or behind PACI's deferred step (``--overlap-modes``), and with ``--enable-vocab-parallel`` the
vocabulary split's passes and messages in the event engine (`megatron.pipeline.simulation.links`;
the output layer's on the runtime's tree, ``--vocab-tree-arity``, default 2, ``fan`` N - 1).
It reports samples/s of the whole cluster and the fraction of the physical limit (a step's
compute over the N ranks, no bubble, no communication).

The report (`summary`, `markdown`) is in `megatron.benchmarks.projection_report`.
"""

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

from megatron.pipeline.schedules import SIMULATED_SCHEDULES
from megatron.pipeline.schedules.vocab_passes import splits_input, with_vocab_passes
from megatron.pipeline.simulation.costs import StageCosts
from megatron.pipeline.simulation.engine import simulate
from megatron.pipeline.simulation.links import (
    CLUSTERS,
    Communication,
    LinkModel,
    RankLayout,
    gradient_reduction_s,
    hop_matrix,
)
from megatron.pipeline.simulation.results import steady_state_throughput

from .calibration_file import profile_sizes, read_calibration, stage_costs_from_calibration
from .projection_report import summary

PAPER = {"best_flush_gb128": 1.69, "best_flush_gb256": 1.41, "same_configuration": 2.04}

PRESETS = {
    # GPT-2 Medium as in the PACI paper; 8 x RTX PRO 6000 Blackwell (PCIe, no NVLink).
    "gpt2-medium": dict(
        num_layers=24,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        vocab_size=50304,
        stages=8,
        global_batch_sizes=[128, 256],
        micro_batch_sizes=[1, 2, 4, 8, 16],
        microbatches=None,
        schedules=["1f1b", "paci"],
        stage_layers=None,
        peak_tflops=504.0,
        memory_bandwidth_gbs=1792.0,
        p2p_latency_us=20.0,
        p2p_bandwidth_gbs=20.0,
        efficiency_max=0.55,
        efficiency_half_tokens=2048.0,
    ),
    # Zero Bubble's 28.3B configuration: 62 layers + embedding + output = 64 slots on 32
    # stages (the ends hold one layer and the embedding / output layer), micro-batch 1, A100.
    "zb-28b": dict(
        num_layers=62,
        hidden_size=6144,
        num_attention_heads=48,
        seq_length=1024,
        vocab_size=50304,
        stages=32,
        global_batch_sizes=None,
        micro_batch_sizes=[1],
        microbatches=[32, 64, 128],
        schedules=["1f1b", "zb-h1", "paci", "2bw", "pipedream", "gpipe"],
        stage_layers=[1] + [2] * 30 + [1],
        peak_tflops=312.0,
        memory_bandwidth_gbs=2039.0,
        p2p_latency_us=20.0,
        p2p_bandwidth_gbs=25.0,
        efficiency_max=0.55,
        efficiency_half_tokens=512.0,
    ),
    # A Llama-style 70B on H100s as the comparison's (megatron/benchmarks/comparison.py: the
    # FLOP model counts grouped-query attention as full and a 2-matrix FFN of 28672), here
    # TP 8 inside a node and PP 8 across nodes; micro-batch 1 of 4096 tokens.
    "llama-70b": dict(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        seq_length=4096,
        vocab_size=128256,
        stages=8,
        global_batch_sizes=None,
        micro_batch_sizes=[1],
        microbatches=[8, 16, 32],
        schedules=["gpipe", "1f1b", "zb-h1", "2bw", "pipedream", "paci"],
        stage_layers=None,
        peak_tflops=989.0,
        memory_bandwidth_gbs=3350.0,
        p2p_latency_us=5.0,
        p2p_bandwidth_gbs=25.0,
        efficiency_max=0.55,
        efficiency_half_tokens=2048.0,
        tensor_parallel=8,
    ),
}


# ----------------------------------------------------------------------------- arguments
class SettingsError(ValueError):
    """A bad flag or setting of the projection, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SettingsError(message)


def _ints(text: str, least: int = 0) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {text!r}")
    return values


def _positive_ints(text: str) -> list[int]:
    return _ints(text, least=1)


def parse_efficiency(text: str) -> dict[int, float]:
    """'1:0.2,2:0.3' -> {1: 0.2, 2: 0.3}; each value in (0, 1]."""
    curve = {}
    for part in text.split(","):
        try:
            size, value = part.split(":")
            size, value = int(size), float(value)
        except ValueError:
            raise SettingsError(
                f"--efficiency: expected 'size:fraction,...', got {part!r}"
            ) from None
        if size < 1 or not 0 < value <= 1:
            raise SettingsError(f"--efficiency: {part!r}: size >= 1 and 0 < fraction <= 1")
        curve[size] = value
    return curve


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-medium")
    _add_model_flags(p)
    _add_cost_flags(p)
    _add_cluster_flags(p)
    _add_memory_and_output_flags(p)
    return p


OVERLAP_MODES = ("step", "overlap-grad-reduce", "deferred-step")
FAN_ARITY = "fan"  # --vocab-tree-arity's spelling of arity N - 1 (the runtime's too)
DEFAULT_TREE_ARITY = 2  # the runtime's default


def _overlap_modes(text: str) -> tuple[str, ...]:
    modes = tuple(part for part in text.split(",") if part)
    unknown = [mode for mode in modes if mode not in OVERLAP_MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"expected a comma list of {OVERLAP_MODES}, got {text!r}")
    return modes


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group(
        "cluster: a link model (any of these turns it on; see docs/projection.md section 8)"
    ).add_argument
    c("--cluster", choices=sorted(CLUSTERS), help="a link preset (gpu: 8 GPUs per node, "
      "NVLink 450 GB/s + 2 us, 25 GB/s + 5 us per GPU between nodes); the flags below "
      "override it")  # fmt: skip
    c("--ranks-per-node", type=int, help="GPUs per node (ranks fill nodes in Megatron's order)")
    c("--intra-node-gbs", type=float, help="intra-node bandwidth per GPU (GB/s)")
    c("--inter-node-gbs", type=float, help="inter-node bandwidth per GPU (GB/s)")
    c("--intra-node-latency-us", type=float, help="intra-node latency per message")
    c("--inter-node-latency-us", type=float, help="inter-node latency per message")
    c("--tp", dest="tensor_parallel", type=int, help="tensor-parallel size (default: the preset's "
      "or 1): divides every pass, step, message and gradient evenly")  # fmt: skip
    c("--dp", dest="data_parallel", type=int, help="data-parallel size (default 1)")
    c("--use-distributed-optimizer", action="store_true",
      help="reduce-scatter the gradients and all-gather the parameters after the step")  # fmt: skip
    c("--grad-reduce-bytes-per-param", type=float, default=4.0,
      help="bytes per gradient element reduced (fp32, as Megatron with bf16)")  # fmt: skip
    c("--overlap-modes", type=_overlap_modes, default=OVERLAP_MODES,
      help="when the reduction runs: 'step' (after the last backward), "
      "'overlap-grad-reduce' (from the last backward's start), 'deferred-step' (PACI: "
      "behind its next passes)")  # fmt: skip
    c("--vocab-tree-arity", "--vocab-parallel-tree-arity", dest="vocab_tree_arity",
      metavar="K|fan", help="with --enable-vocab-parallel: children per rank of the tree the "
      "output layer's messages travel on, rooted at the last stage, as the runtime's "
      "--vocab-parallel-tree-arity (default 2; fan: arity N - 1, every rank the last stage's "
      "child)")  # fmt: skip


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and pipeline (default: the preset's)").add_argument
    for flag in (
        "num-layers",
        "hidden-size",
        "num-attention-heads",
        "seq-length",
        "vocab-size",
        "stages",
        "ffn-hidden-size",
    ):
        g(f"--{flag}", type=int)
    g("--stage-layers", type=_ints, help="layers per stage, e.g. 4,3,3,3,3,3,3,2 (default even)")
    g(
        "--uniform-stages",
        action="store_true",
        help="give every stage the mean stage cost (a perfectly balanced pipeline)",
    )
    g(
        "--enable-vocab-parallel",
        action="store_true",
        help="the output layer, the loss and the input embedding split by vocabulary over the "
        "pipeline ranks, as the runtime's --enable-vocab-parallel",
    )
    g("--global-batch-sizes", type=_positive_ints, help="m = global batch / micro-batch size")
    g(
        "--microbatches",
        type=_positive_ints,
        help="m per step directly (instead of global batch sizes)",
    )
    g("--micro-batch-sizes", type=_positive_ints)
    one_chunk = sorted(n for n, s in SIMULATED_SCHEDULES.items() if s.placement is None)
    g("--schedules", help="comma list of: " + ", ".join(one_chunk))


def _add_cost_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cost model (ignored parts: see --calibration)").add_argument
    c(
        "--calibration",
        dest="calibration_path",
        metavar="FILE.json",
        help="measured costs (replace the cost model)",
    )
    c("--peak-tflops", type=float, help="device peak (bf16 dense) TFLOP/s")
    c("--efficiency", help="per-microbatch efficiency curve 'b:e,...' (fraction of peak)")
    c("--efficiency-max", type=float, help="default curve: e_max")
    c("--efficiency-half-tokens", type=float, help="default curve: n_half (tokens)")
    c("--memory-bandwidth-gbs", type=float, help="for the optimizer step")
    c(
        "--optimizer-bytes-per-param",
        type=float,
        default=32.0,
        help="bytes an AdamW mixed-precision step moves per parameter",
    )
    c("--p2p-latency-us", type=float, help="per-hop latency")
    c("--p2p-bandwidth-gbs", type=float, help="per-hop bandwidth (GB/s)")
    c("--p2p-s", type=float, help="fixed per-hop p2p time in seconds (overrides the model)")
    c(
        "--flush-sync-ms",
        type=float,
        default=0.0,
        help="extra per-step cost of synchronous schedules (global grad-norm/loss all-reduce, "
        "host sync); 0 by default",
    )


def _add_memory_and_output_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("memory model").add_argument
    m(
        "--param-bytes",
        type=float,
        default=18.0,
        help="bytes per parameter for weights, grads and AdamW states (bf16 + fp32 master)",
    )
    m(
        "--activation-bytes-per-token",
        type=float,
        default=None,
        help="per layer and token (default 34 x hidden: flash attention, no recompute)",
    )
    o = p.add_argument_group("output").add_argument
    o("--json", dest="json_path", metavar="FILE", help="write every figure as JSON")
    o(
        "--markdown",
        dest="markdown_path",
        metavar="FILE",
        help="write the report tables as Markdown",
    )


def parse_args(argv=None) -> "ProjectionOptions":
    """The projection's options from its flags (`ProjectionOptions.from_namespace`); raises
    `SettingsError`."""
    return ProjectionOptions.from_namespace(build_parser().parse_args(argv))


@dataclass(frozen=True)
class ProjectionOptions:
    """The projection's settings, resolved once from the flags: each value is the flag's, else
    a calibration's model shape, else the preset's. Field names follow the flags'."""

    preset: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    """4 x hidden_size unless a flag or the calibration's model gives it."""
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    stages: int
    stage_layers: tuple[int, ...]
    """Layers per stage, summing to num_layers: --stage-layers, else the preset's, else even."""
    uniform_stages: bool
    """Every stage at the mean stage cost (a perfectly balanced pipeline)."""
    enable_vocab_parallel: bool
    """The output layer and loss split by vocabulary over the pipeline ranks (the runtime's)."""
    global_batch_sizes: tuple[int, ...] | None
    """Rows (global batch, b, global batch / b); None: `microbatches` gives m directly."""
    microbatches: tuple[int, ...] | None
    micro_batch_sizes: tuple[int, ...]
    """With a calibration, only the sizes it has a profile for."""
    schedules: tuple[str, ...]
    """Simulated schedules, one model chunk per stage each."""
    calibration_path: str | None
    calibration_data: dict | None
    """The calibration file's contents; None: the cost model gives the costs."""
    peak_tflops: float
    efficiency_points: dict[int, float] | None
    """--efficiency's curve, micro-batch size -> fraction of peak (interpolated in between);
    None: the assumed curve from efficiency_max and efficiency_half_tokens."""
    efficiency_max: float
    efficiency_half_tokens: float
    memory_bandwidth_gbs: float
    optimizer_bytes_per_param: float
    p2p_latency_us: float
    p2p_bandwidth_gbs: float
    p2p_s: float | None
    """Fixed seconds per hop: replaces the p2p model and a calibration's measured p2p."""
    flush_sync_ms: float
    """Extra per-step cost of the schedules that flush every step."""
    param_bytes: float
    """Bytes per parameter for weights, gradients and optimizer states."""
    activation_bytes_per_token: float | None
    """Per layer and token; None: 34 x hidden_size."""
    json_path: str | None
    markdown_path: str | None
    links: LinkModel | None = None
    """The link model (--cluster and the link flags); None: one p2p time per hop, no more."""
    tensor_parallel: int = 1
    data_parallel: int = 1
    use_distributed_optimizer: bool = False
    grad_reduce_bytes_per_param: float = 4.0
    overlap_modes: tuple[str, ...] = OVERLAP_MODES
    vocab_tree_arity: int = DEFAULT_TREE_ARITY
    """Children per rank of the output layer's message tree (`Communication.vocab_tree_arity`;
    N - 1: the fan through the last stage)."""

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "ProjectionOptions":
        """The options from `build_parser`'s namespace: preset and calibration shape filled in,
        schedules and stage layers checked, unmeasured micro-batch sizes left out."""
        given = vars(namespace)
        if given["microbatches"] is not None and given["global_batch_sizes"] is not None:
            raise SettingsError("give --global-batch-sizes or --microbatches, not both")
        path = given["calibration_path"]
        calibration = read_calibration(path) if path else None
        values = _with_defaults(given, calibration)
        schedules = _schedules(values["schedules"])
        stage_layers = _stage_layers(values)
        sizes = values["micro_batch_sizes"]
        if calibration is not None:
            sizes = _measured_sizes(path, calibration, sizes)
        efficiency = given["efficiency"]
        values.update(
            stage_layers=tuple(stage_layers),
            global_batch_sizes=_optional_tuple(values["global_batch_sizes"]),
            microbatches=_optional_tuple(values["microbatches"]),
            micro_batch_sizes=tuple(sizes),
            schedules=tuple(schedules),
            calibration_data=calibration,
            efficiency_points=parse_efficiency(efficiency) if efficiency else None,
            **_cluster_values(values),
        )
        return cls(**{field.name: values[field.name] for field in dataclasses.fields(cls)})

    def shape(self) -> "Shape":
        return Shape(
            self.num_layers,
            self.hidden_size,
            self.ffn_hidden_size,
            self.seq_length,
            self.vocab_size,
        )


_LINK_FLAGS = {
    "ranks_per_node": ("ranks_per_node", 1),
    "intra_node_gbs": ("intra_bandwidth_gbs", 1),
    "inter_node_gbs": ("inter_bandwidth_gbs", 1),
    "intra_node_latency_us": ("intra_latency_s", 1e-6),
    "inter_node_latency_us": ("inter_latency_s", 1e-6),
}


def _cluster_values(values: dict) -> dict:
    """The link model (the --cluster preset, else the gpu cluster's values, with the link
    flags given over it; None when neither is given) and the parallel sizes."""
    given = {flag: values[flag] for flag in _LINK_FLAGS if values[flag] is not None}
    links = None
    if values["cluster"] or given:
        links = CLUSTERS[values["cluster"] or "gpu"]
        try:
            links = dataclasses.replace(links, **{_LINK_FLAGS[f][0]: v * _LINK_FLAGS[f][1]
                                                  for f, v in given.items()})  # fmt: skip
        except ValueError as error:
            raise SettingsError(f"the link model: {error}") from None
    sizes = {
        name: values[name] if values[name] is not None else values.get(f"preset_{name}", 1)
        for name in ("tensor_parallel", "data_parallel")
    }
    if min(sizes.values()) < 1:
        raise SettingsError("--tp and --dp must be >= 1")
    if links is None and (max(sizes.values()) > 1 or values["use_distributed_optimizer"]):
        raise SettingsError("--tp, --dp and --use-distributed-optimizer need a link model: "
                            "give --cluster gpu or the link flags")  # fmt: skip
    return {"links": links, **sizes, "vocab_tree_arity": _vocab_tree_arity(values, links)}


def _vocab_tree_arity(values: dict, links: LinkModel | None) -> int:
    """--vocab-tree-arity as children per rank: an integer >= 1, or `fan` (N - 1)."""
    given = values["vocab_tree_arity"]
    if given is None:
        return DEFAULT_TREE_ARITY
    if links is None or not values["enable_vocab_parallel"]:
        raise SettingsError("--vocab-tree-arity needs --enable-vocab-parallel and a link model "
                            "(--cluster gpu or the link flags)")  # fmt: skip
    if given == FAN_ARITY:
        return max(values["stages"] - 1, 1)
    try:
        arity = int(given)
    except ValueError:
        arity = 0
    if arity < 1:
        raise SettingsError(f"--vocab-tree-arity must be an integer >= 1 or {FAN_ARITY}, "
                            f"got {given!r}")  # fmt: skip
    return arity


def _with_defaults(given: dict, calibration: dict | None) -> dict:
    """The flags' values; where a flag is not given, the calibration's model shape, then the
    preset's value (the FFN: 4 x hidden)."""
    preset = dict(PRESETS[given["preset"]])
    if given["calibration_path"] and given["stage_layers"] is None:
        preset["stage_layers"] = None  # a calibration maps layers evenly
    if given["microbatches"] is not None or given["global_batch_sizes"] is not None:
        del preset["microbatches"], preset["global_batch_sizes"]  # the flag given sets the rows
    model = calibration.get("model") if calibration is not None else None
    measured_shape = {
        key: model[key]
        for key in (_SHAPE_KEYS if isinstance(model, dict) else ())
        if isinstance(model.get(key), int)
    }
    values = dict(given)
    for key in ("tensor_parallel", "data_parallel"):  # only some presets set them
        values[f"preset_{key}"] = preset.pop(key, 1)
    for key, value in (*measured_shape.items(), *preset.items()):
        if values[key] is None:
            values[key] = value
    if values["ffn_hidden_size"] is None:
        values["ffn_hidden_size"] = 4 * values["hidden_size"]
    return values


def _stage_layers(values: dict) -> list[int]:
    """Layers per stage: the given split, checked against the model and stages, or the even one."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "stages"):
        if values[name] < 1:
            raise SettingsError(f"--{name.replace('_', '-')} must be >= 1")
    num_layers, stages, split = values["num_layers"], values["stages"], values["stage_layers"]
    even = [num_layers // stages] * stages
    if split is None:
        if num_layers % stages:
            raise SettingsError(
                f"--num-layers {num_layers} does not split evenly into {stages} "
                "stages: give --stage-layers"
            )
        split = even
    split = list(split)
    if len(split) != stages or sum(split) != num_layers:
        raise SettingsError(
            f"--stage-layers {split}: need {stages} entries summing to {num_layers}"
        )
    if values["calibration_path"] and split != even:
        raise SettingsError("--calibration maps layers evenly onto stages: drop --stage-layers")
    return split


def _measured_sizes(path: str, calibration: dict, sizes: list[int]) -> list[int]:
    """The micro-batch sizes the calibration has a profile for (all, if it has one profile)."""
    measured = profile_sizes(calibration)
    missing = [b for b in sizes if measured is not None and b not in measured]
    if missing:
        print(
            f"note: {path} has no profile for micro-batch size(s) {missing}: left out",
            file=sys.stderr,
        )
        sizes = [b for b in sizes if b not in missing]
    if not sizes:
        raise SettingsError(f"{path}: none of the micro-batch sizes was measured")
    return sizes


def _optional_tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


_SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
)


def _schedules(value) -> list[str]:
    names = value.split(",") if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in SIMULATED_SCHEDULES]
    if unknown:
        raise SettingsError(f"unknown schedule(s) {unknown} (known: {sorted(SIMULATED_SCHEDULES)})")
    chunked = [n for n in names if SIMULATED_SCHEDULES[n].placement is not None]
    if chunked:  # the cost model and the memory model are per stage: one chunk per rank
        raise SettingsError(
            f"the projection models one model chunk per stage; {chunked} run "
            "several per rank (simulate them with tools/simulate_pipeline.py)"
        )
    return names


# ----------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden: int
    ffn: int
    seq: int
    vocab: int

    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn
        return 4 * h * h + 2 * h * f + 9 * h + f  # QKV + proj + FFN weights, biases, 2 norms

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq * self.hidden

    def output_params(self) -> int:
        return self.vocab * self.hidden + 2 * self.hidden  # output layer + final norm


def layer_flops(shape: Shape, mbs: int) -> tuple[float, float, float]:
    """(forward, input-gradient backward, weight-gradient backward) FLOPs of one layer."""
    t, h, f, s = mbs * shape.seq, shape.hidden, shape.ffn, shape.seq
    gemm = 2.0 * t * (4 * h * h + 2 * h * f)
    attention = 2.0 * t * s * h  # QK^T and AV, causal: half of the square is computed
    return gemm + attention, gemm + 2 * attention, gemm


def output_flops(shape: Shape, mbs: int) -> tuple[float, float, float]:
    gemm = 2.0 * mbs * shape.seq * shape.hidden * shape.vocab
    return gemm, gemm, gemm


def default_efficiency(mbs: int, seq: int, e_max: float, half_tokens: float) -> float:
    tokens = mbs * seq
    return e_max * tokens / (tokens + half_tokens)


def efficiency_at(curve: dict[int, float], mbs: int) -> float:
    """The curve's value at `mbs`, interpolated linearly in log(mbs) between given points."""
    if mbs in curve:
        return curve[mbs]
    sizes = sorted(curve)
    if mbs < sizes[0] or mbs > sizes[-1]:
        raise SettingsError(f"--efficiency has no value for micro-batch size {mbs} ({sizes})")
    hi = next(s for s in sizes if s > mbs)
    lo = max(s for s in sizes if s < mbs)
    w = (math.log(mbs) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return curve[lo] + w * (curve[hi] - curve[lo])


def efficiency_curve(options: ProjectionOptions) -> dict[int, float]:
    """The fraction of peak at each micro-batch size: --efficiency's curve, else the assumed one."""
    sizes = sorted(set(options.micro_batch_sizes))
    if options.efficiency_points:
        return {b: efficiency_at(options.efficiency_points, b) for b in sizes}
    e_max, half_tokens = options.efficiency_max, options.efficiency_half_tokens
    return {b: default_efficiency(b, options.seq_length, e_max, half_tokens) for b in sizes}


def p2p_model(options: ProjectionOptions, mbs: int) -> float:
    if options.p2p_s is not None:
        return options.p2p_s
    num_bytes = mbs * options.seq_length * options.hidden_size * 2  # bf16 activation
    return options.p2p_latency_us * 1e-6 + num_bytes / (options.p2p_bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class VocabMessages:
    """Seconds per microbatch, (forward, backward), of the vocabulary split's messages: on
    every rank, and extra on the last rank (the output layer's exchange with every other
    rank) and on the first (the input embedding's)."""

    every: tuple[float, float] = (0.0, 0.0)
    last: tuple[float, float] = (0.0, 0.0)
    first: tuple[float, float] = (0.0, 0.0)


def vocab_messages_s(options: ProjectionOptions, mbs: int) -> VocabMessages:
    """The messages of the output layer and the input embedding split over the N pipeline
    ranks, as the runtime sends them (`pipeline.vocab_parallel`, point to point, in the model's
    dtype, bf16 here, with fp32 labels and statistics): the last stage's hidden state and
    labels to each other rank (T h bf16 and T fp32) and each shard's output back (3 T fp32 and
    2 T h bf16) in the forward, the softmax statistics out (3 T fp32) in the backward; each
    rank's part of the input embedding to the first stage (T h) in the forward, its gradient
    back (T h) in the backward.
    A rank sends and receives one of each; the last and the first rank N - 2 more of theirs
    through their link. Counted as busy time, each with one hop latency: no overlap with
    compute is assumed."""
    n, tokens, hidden = options.stages, mbs * options.seq_length, options.hidden_size
    if n == 1:
        return VocabMessages()
    bandwidth, latency = options.p2p_bandwidth_gbs * 1e9, options.p2p_latency_us * 1e-6
    forward_bytes = tokens * (2 * hidden + 4) + tokens * (3 * 4 + 2 * hidden * 2)
    backward_bytes = 3 * tokens * 4
    embed_bytes = tokens * hidden * 2
    every = (
        3 * latency + (forward_bytes + embed_bytes) / bandwidth,
        2 * latency + (backward_bytes + embed_bytes) / bandwidth,
    )
    fan = n - 2  # the last (first) rank's messages beyond one rank's own
    last = (fan * forward_bytes / bandwidth, fan * backward_bytes / bandwidth)
    first = (fan * embed_bytes / bandwidth, fan * embed_bytes / bandwidth)
    return VocabMessages(every, last, first)


def modelled_costs(
    options: ProjectionOptions, shape: Shape, mbs: int, efficiency: float
) -> StageCosts:
    rate = options.peak_tflops * 1e12 * efficiency
    lf, lb, lw = (x / rate for x in layer_flops(shape, mbs))
    of, ob, ow = (x / rate for x in output_flops(shape, mbs))
    bytes_per_s = options.memory_bandwidth_gbs * 1e9
    per_param = options.optimizer_bytes_per_param / bytes_per_s
    forward, backward, wgrad, step = [], [], [], []
    for s, layers in enumerate(options.stage_layers):
        params = layers * shape.layer_params() + vocab_params(options, shape, s)
        f, b, w = layers * lf, layers * lb, layers * lw
        share = _output_share(options, s)
        forward.append(f + share * of)
        backward.append(b + share * ob)
        wgrad.append(w + share * ow)
        step.append(params * per_param)
    if options.enable_vocab_parallel:
        messages = vocab_messages_s(options, mbs)
        forward = [f + messages.every[0] for f in forward]
        backward = [b + messages.every[1] for b in backward]
        for stage, (f, b) in ((-1, messages.last), (0, messages.first)):
            forward[stage] += f
            backward[stage] += b
    return StageCosts(forward, backward, wgrad, step, p2p_model(options, mbs), "cost model")


def _output_share(options: ProjectionOptions, stage: int) -> float:
    """The part of the output layer and loss that `stage` runs: all of it on the last stage,
    1/N on every stage with the vocabulary split over the pipeline."""
    if options.enable_vocab_parallel:
        return 1.0 / options.stages
    return 1.0 if stage == options.stages - 1 else 0.0


def vocab_params(options: ProjectionOptions, shape: Shape, stage: int) -> float:
    """Parameters of the embedding (the first stage's) and the output layer (with the final
    norm; the last stage's), or 1/N of both on every stage with the vocabulary split."""
    if options.enable_vocab_parallel:
        return (shape.embedding_params() + shape.output_params()) / options.stages
    on_first = shape.embedding_params() if stage == 0 else 0
    return on_first + (shape.output_params() if stage == options.stages - 1 else 0)


def calibrated_costs(options: ProjectionOptions, mbs: int) -> StageCosts:
    """The calibration's measured costs at `mbs`; p2p: --p2p-s, else measured, else modelled."""
    path = options.calibration_path
    try:
        costs = stage_costs_from_calibration(
            options.calibration_data, options.stages, mbs, source=path
        )
    except ValueError as e:
        raise SettingsError(f"{path}: {e}") from None
    if options.p2p_s is not None:
        p2p = options.p2p_s
    elif costs.p2p_latency is not None:
        p2p = costs.p2p_latency
    else:
        p2p = p2p_model(options, mbs)
    return dataclasses.replace(costs, p2p_latency=p2p)


# ----------------------------------------------------------------------------- simulation
@dataclass
class Outcome:
    schedule: str
    micro_batch_size: int
    microbatches: int
    samples_per_s: float
    step_time_s: float
    bottleneck_busy_fraction: float
    max_drift: int
    drift_bound: int | None
    peak_inflight: list[int]
    held_activations: list[int]
    extra_weight_versions: list[int]


def _held_activations(result, splits_backward: bool) -> list[int]:
    """Per stage, the most microbatches whose activations are (partly) alive: forwarded and
    not yet through the pass that frees them (W for split schedules, else B)."""
    release = "W" if splits_backward else "B"
    peaks = []
    for s in range(result.num_stages):
        deltas = []
        for e in result.timeline:
            if e.stage != s:
                continue
            kind = e.action.kind.value
            if kind == "F":
                deltas.append((e.start_s, 1, 1))
            elif kind == release:
                deltas.append((e.end_s, 0, -1))
        live = peak = 0
        for _, _, delta in sorted(deltas):
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def steady_state(name: str, costs: StageCosts, m: int, mbs: int, flush_sync_s: float) -> Outcome:
    """Samples/s in steady state (`results.steady_state_throughput`): the window from step k to
    step 2k of a run that drains after step 2k, k >= 3 and >= 8N/m."""
    schedule = SIMULATED_SCHEDULES[name]
    n = len(costs.forward)
    step = costs.step
    if schedule.flushes_every_call and flush_sync_s:
        step = [s + flush_sync_s for s in step]
    k = max(3, math.ceil(8 * n / m))
    steps = 2 * k + math.ceil(n / m)
    full = simulate(
        schedule,
        num_stages=n,
        microbatches_per_step=m,
        steps=steps,
        forward_cost=costs.forward,
        backward_cost=costs.backward,
        weight_grad_cost=costs.weight_grad,
        step_cost=step,
        p2p_latency=costs.p2p_latency,
        record_timeline=True,
    )
    period = m / steady_state_throughput(full.timeline, n, m, steps, first=k)
    per_stage = [
        m * (f + b + w) + s
        for f, b, w, s in zip(costs.forward, costs.backward, costs.weight_grad, step)
    ]
    return Outcome(
        schedule=name,
        micro_batch_size=mbs,
        microbatches=m,
        samples_per_s=m * mbs / period,
        step_time_s=period,
        bottleneck_busy_fraction=max(per_stage) / period,
        max_drift=max(full.max_drift_per_stage),
        drift_bound=schedule.drift_bound(0, n, m) if schedule.drift_bound else None,
        peak_inflight=full.peak_inflight_per_stage,
        held_activations=_held_activations(full, schedule.splits_backward),
        extra_weight_versions=full.measured_extra_weight_versions,
    )


# ----------------------------------------------------------------------------- memory
def stage_memory_gb(options: ProjectionOptions, shape: Shape, outcome: Outcome) -> list[float]:
    """Per stage: weights + grads + optimizer states, stashed weight versions (bf16) and the
    activations of the microbatches it holds (`_held_activations`)."""
    per_token = options.activation_bytes_per_token or 34.0 * shape.hidden
    tokens = outcome.micro_batch_size * shape.seq
    memory = []
    for s, layers in enumerate(options.stage_layers):
        params = layers * shape.layer_params() + vocab_params(options, shape, s)
        activation = layers * per_token * tokens
        # fp32 logits kept for the loss backward: on the last stage for every microbatch it
        # holds; with the vocabulary split, a shard's for the one microbatch between its
        # output passes
        logits = _output_share(options, s) * tokens * shape.vocab * 4
        if not options.enable_vocab_parallel:
            activation, logits = activation + logits, 0.0
        total = params * options.param_bytes + outcome.extra_weight_versions[s] * params * 2
        total += outcome.held_activations[s] * activation + logits
        memory.append(total / 1e9)
    return memory


# ----------------------------------------------------------------------------- the report
def configurations(options: ProjectionOptions) -> list[tuple[int | None, int, int]]:
    """(global batch, micro-batch size, m) rows; m = global batch / micro-batch size."""
    rows = []
    if options.global_batch_sizes:
        for gb in options.global_batch_sizes:
            for mbs in options.micro_batch_sizes:
                if gb % mbs == 0:
                    rows.append((gb, mbs, gb // mbs))
    else:
        for mbs in options.micro_batch_sizes:
            for m in options.microbatches:
                rows.append((m * mbs, mbs, m))
    return rows


def run(options: ProjectionOptions) -> dict:
    """Every configuration's steady state under each schedule, with the inputs and the summary
    (with a link model: `run_cluster`'s report)."""
    if options.links is not None:
        return run_cluster(options)
    shape = options.shape()
    calibrated = options.calibration_data is not None
    if calibrated and options.enable_vocab_parallel:
        raise SettingsError(
            "--enable-vocab-parallel re-splits the output layer: use the cost model, or a "
            "per-layer calibration with tools/balance_layout.py"
        )
    curve = None if calibrated else efficiency_curve(options)
    costs = {}
    for mbs in sorted(set(options.micro_batch_sizes)):
        if calibrated:
            costs[mbs] = calibrated_costs(options, mbs)
        else:
            costs[mbs] = modelled_costs(options, shape, mbs, curve[mbs])
        if options.uniform_stages:
            costs[mbs] = costs[mbs].uniform()
    flush_sync = options.flush_sync_ms * 1e-3
    rows = []
    for gb, mbs, m in configurations(options):
        for name in options.schedules:
            least = SIMULATED_SCHEDULES[name].min_microbatches_per_step(options.stages)
            if m < least:
                continue
            outcome = steady_state(name, costs[mbs], m, mbs, flush_sync)
            row = {"global_batch": gb, **outcome.__dict__}
            memory = stage_memory_gb(options, shape, outcome)
            row["peak_memory_gb"] = max(memory)
            row["mean_memory_gb"] = sum(memory) / len(memory)
            row["memory_gb_per_stage"] = memory
            rows.append(row)
    return {
        "inputs": _inputs(options, shape, curve, costs),
        "per_sample_curve": _per_sample_curve(costs, shape, options),
        "rows": rows,
        "summary": summary(rows, options.schedules, options.stages),
        "paper": PAPER,
    }


def _inputs(options: ProjectionOptions, shape: Shape, curve: dict | None, costs: dict) -> dict:
    inputs = {
        "preset": options.preset,
        "model": shape.__dict__,
        "stages": options.stages,
        "stage_layers": list(options.stage_layers),
        "uniform_stages": options.uniform_stages,
        "schedules": list(options.schedules),
        "source": options.calibration_path or "cost model",
        "flush_sync_ms": options.flush_sync_ms,
        "p2p_s": {str(b): c.p2p_latency for b, c in costs.items()},
        "stage_costs": {str(b): _cost_record(c) for b, c in costs.items()},
        "command": "python tools/project_paper_scale.py " + " ".join(sys.argv[1:]),
    }
    if curve is not None:
        inputs.update(
            peak_tflops=options.peak_tflops,
            efficiency_curve={str(b): e for b, e in curve.items()},
            efficiency_curve_origin=(
                "--efficiency"
                if options.efficiency_points
                else f"assumed: e(b) = {options.efficiency_max} * b*seq / (b*seq + "
                f"{options.efficiency_half_tokens:g})"
            ),
            memory_bandwidth_gbs=options.memory_bandwidth_gbs,
            optimizer_bytes_per_param=options.optimizer_bytes_per_param,
            p2p_model=(
                f"{options.p2p_s} s fixed"
                if options.p2p_s is not None
                else f"{options.p2p_latency_us} us + bytes / {options.p2p_bandwidth_gbs} GB/s"
            ),
        )
    return inputs


def _per_sample_curve(costs: dict, shape: Shape, options: ProjectionOptions) -> list[dict]:
    """GPU time per sample of a middle stage (forward + backward) at each micro-batch size."""
    curve = []
    mid = min(1, options.stages - 1)
    for mbs, c in sorted(costs.items()):
        per_sample = (c.forward[mid] + c.backward[mid] + c.weight_grad[mid]) / mbs
        layers = options.stage_layers[mid]
        flops = sum(layer_flops(shape, mbs)) * layers / mbs
        curve.append(
            {
                "micro_batch_size": mbs,
                "middle_stage_ms_per_sample": per_sample * 1e3,
                "achieved_tflops": flops / per_sample / 1e12 if per_sample > 0 else None,
                "p2p_ms": c.p2p_latency * 1e3,
            }
        )
    base = curve[-1]["middle_stage_ms_per_sample"]
    for point in curve:
        point["relative_to_largest"] = point["middle_stage_ms_per_sample"] / base
    return curve


def _cost_record(costs: StageCosts) -> dict:
    return {
        "forward": costs.forward,
        "backward": costs.backward,
        "weight_grad": costs.weight_grad,
        "step": costs.step,
        "p2p_s": costs.p2p_latency,
        "source": costs.source,
    }


# ----------------------------------------------------------------------------- the cluster
@dataclass(frozen=True)
class ClusterPlan:
    """One micro-batch size on the cluster: per-GPU pass costs (the output layer on the last
    stage, or with the vocabulary split each rank's VF and VB), and the link model's costs."""

    costs: StageCosts
    vocab: tuple[float, float]
    communication: Communication

    def limit_step_s(self, m: int) -> float:
        """The physical limit of a step: all of its compute (passes, vocabulary passes,
        optimizer steps) spread evenly over the N ranks, with no bubble and no communication."""
        c, n = self.costs, len(self.costs.forward)
        passes = sum(c.forward) + sum(c.backward) + sum(c.weight_grad) + n * sum(self.vocab)
        return (m * passes + sum(c.step)) / n


def vocab_message_bytes(shape: Shape, tokens: int) -> dict[str, float]:
    """Bytes of each message of the vocabulary split (`vocab_messages_s` lists them): the
    hidden state and labels out, a shard's output back, the statistics out, an embedding part
    in and its gradient out."""
    hidden = shape.hidden
    return {
        "hidden": tokens * (2 * hidden + 4),
        "shard": tokens * (3 * 4 + 2 * hidden * 2),
        "stats": 3 * tokens * 4,
        "embed": tokens * hidden * 2,
        "embed_grad": tokens * hidden * 2,
    }


def cluster_costs(options: ProjectionOptions, shape: Shape, mbs: int, efficiency: float):
    """(per-GPU `StageCosts`, (VF, VB) per rank): the cost model with every pass and step
    divided over the tensor-parallel ranks; the output layer on the last stage, or split into
    the vocabulary passes."""
    tp, n, split = options.tensor_parallel, options.stages, options.enable_vocab_parallel
    rate = options.peak_tflops * 1e12 * efficiency * tp
    lf, lb, lw = (x / rate for x in layer_flops(shape, mbs))
    of, ob, ow = (x / rate for x in output_flops(shape, mbs))
    per_param = options.optimizer_bytes_per_param / (options.memory_bandwidth_gbs * 1e9) / tp
    forward, backward, wgrad, step = [], [], [], []
    for s, layers in enumerate(options.stage_layers):
        output = 0.0 if split else float(s == n - 1)
        forward.append(layers * lf + output * of)
        backward.append(layers * lb + output * ob)
        wgrad.append(layers * lw + output * ow)
        step.append((layers * shape.layer_params() + vocab_params(options, shape, s)) * per_param)
    vocab = ((of + ob) / n, ow / n) if split else (0.0, 0.0)
    return StageCosts(forward, backward, wgrad, step, None, "cost model, link model"), vocab


def cluster_communication(options: ProjectionOptions, shape: Shape, mbs: int) -> Communication:
    """The link model's costs of one micro-batch size: the pipeline's hops, each stage's
    data-parallel reduction (and all-gather with the distributed optimizer), the vocabulary
    split's messages; every message and gradient divided over the tensor-parallel ranks."""
    links, tp = options.links, options.tensor_parallel
    layout = RankLayout(tp, options.stages, options.data_parallel, links.ranks_per_node)
    tokens = mbs * shape.seq
    reduce, gather = [], []
    for s, layers in enumerate(options.stage_layers):
        params = (layers * shape.layer_params() + vocab_params(options, shape, s)) / tp
        grad_bytes = params * options.grad_reduce_bytes_per_param
        distributed = options.use_distributed_optimizer
        reduce.append(gradient_reduction_s(links, layout, s, grad_bytes, distributed))
        in_node = layout.data_group_in_node(s)
        gather.append(links.all_gather_s(params * 2, layout.data, in_node) if distributed else 0)
    messages = {}
    if options.enable_vocab_parallel:
        for kind, num_bytes in vocab_message_bytes(shape, tokens).items():
            messages[kind] = _frozen(hop_matrix(links, layout, num_bytes / tp))
    hops = _frozen(hop_matrix(links, layout, tokens * shape.hidden * 2 / tp))
    return Communication(hops, tuple(reduce), tuple(gather), messages,
                         vocab_tree_arity=options.vocab_tree_arity)  # fmt: skip


def _frozen(matrix: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(row) for row in matrix)


def cluster_steady_state(
    options: ProjectionOptions, name: str, plan: ClusterPlan, m: int, mode: str
) -> dict:
    """One schedule's steady state on the cluster under an overlap mode (`OVERLAP_MODES`):
    samples/s of the whole cluster (every replica) and its fraction of the physical limit."""
    schedule = SIMULATED_SCHEDULES[name]
    if options.enable_vocab_parallel:
        schedule = with_vocab_passes(schedule, splits_input(schedule))
    comm = plan.communication
    if mode == "overlap-grad-reduce":
        comm = dataclasses.replace(comm, overlap_grad_reduce=True)
    n = options.stages
    k = max(3, math.ceil(8 * n / m))
    steps = 2 * k + math.ceil(n / m)
    full = simulate(schedule, num_stages=n, microbatches_per_step=m, steps=steps,
                    vocab_forward_cost=plan.vocab[0], vocab_backward_cost=plan.vocab[1],
                    communication=comm, deferred_step=mode == "deferred-step",
                    **plan.costs.simulate_kwargs())  # fmt: skip
    period = m / steady_state_throughput(full.timeline, n, m, steps, first=k)
    return {
        "schedule": name,
        "mode": mode,
        "step_time_s": period,
        "fraction_of_limit": plan.limit_step_s(m) / period,
        "max_drift": max(full.max_drift_per_stage),
    }


def run_cluster(options: ProjectionOptions) -> dict:
    """Every configuration, schedule and overlap mode on the link model's cluster."""
    if options.calibration_data is not None:
        raise SettingsError("the link model projects from the cost model: drop --calibration")
    shape, curve, rows, plans = options.shape(), efficiency_curve(options), [], {}
    for mbs in sorted(set(options.micro_batch_sizes)):
        costs, vocab = cluster_costs(options, shape, mbs, curve[mbs])
        plans[mbs] = ClusterPlan(costs, vocab, cluster_communication(options, shape, mbs))
    for gb, mbs, m in configurations(options):
        limit = m * mbs * options.data_parallel / plans[mbs].limit_step_s(m)
        for name in options.schedules:
            if m < SIMULATED_SCHEDULES[name].min_microbatches_per_step(options.stages):
                continue
            for mode in options.overlap_modes:
                if mode == "deferred-step" and name != "paci":
                    continue
                row = cluster_steady_state(options, name, plans[mbs], m, mode)
                row.update(global_batch=gb, micro_batch_size=mbs, microbatches=m)
                row.update(
                    samples_per_s=row["fraction_of_limit"] * limit, limit_samples_per_s=limit
                )
                rows.append(row)
    return {"cluster": _cluster_inputs(options, plans), "rows": rows}


def _cluster_inputs(options: ProjectionOptions, plans: dict) -> dict:
    links = options.links
    layout = RankLayout(options.tensor_parallel, options.stages, options.data_parallel,
                        links.ranks_per_node)  # fmt: skip
    per_size = {}
    for mbs, plan in plans.items():
        hops = [plan.communication.hop_s[s][s + 1] for s in range(options.stages - 1)]
        messages = {k: max(max(row) for row in v) for k, v in plan.communication.message_s.items()}
        per_size[str(mbs)] = {
            "pass_ms": (plan.costs.forward[0] + plan.costs.backward[0]
                        + plan.costs.weight_grad[0]) * 1e3,  # fmt: skip
            "hop_ms": [h * 1e3 for h in hops],
            "reduce_ms": [r * 1e3 for r in plan.communication.reduce_s],
            "gather_ms": [g * 1e3 for g in plan.communication.gather_s],
            "vocab_message_ms": {k: v * 1e3 for k, v in messages.items()},
            "step_ms": [s * 1e3 for s in plan.costs.step],
        }
    return {
        "command": "python tools/project_paper_scale.py " + " ".join(sys.argv[1:]),
        "preset": options.preset,
        "links": dataclasses.asdict(links),
        "layout": {"tp": layout.tensor, "pp": layout.pipeline, "dp": layout.data,
                   "nodes": layout.num_nodes},  # fmt: skip
        "vocab_split": options.enable_vocab_parallel,
        "vocab_tree_arity": options.vocab_tree_arity,
        "distributed_optimizer": options.use_distributed_optimizer,
        "efficiency": efficiency_curve(options),
        "per_micro_batch_size": per_size,
    }
