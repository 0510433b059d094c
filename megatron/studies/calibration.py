"""Calibration: per-microbatch forward/backward times of a real megatron-core GPT stage, as the
calibration object the pipeline simulator reads (`tools/calibrate_stage.py` is the command line).

One process, no pipeline: torch.distributed is initialized with world size 1 (gloo on CPU,
NCCL on CUDA) and megatron-core's parallel_state with TP = PP = 1, exactly as
`megatron.training.training.initialize_distributed` does for a run. Stages are built with our
`build_gpt_stage` and `transformer_config`, so the layer spec is the one a run uses: Transformer
Engine's on CUDA when it is installed, else the portable SDPA spec.

What is measured, for every ``--micro-batch-sizes`` entry (median over ``--repeats`` after
``--warmup`` untimed passes; the device is synchronized around every timed pass; ``--clock
process`` times CPU runs with this process's CPU time instead of the wall clock, which a shared
machine's other load does not inflate as long as ``--threads 1``):

* a middle stage (no embedding, no output layer; input a random activation that requires grad,
  as a received one does) with d1 and d2 layers (``--depths``, default 1 and min(4, L));
* a first stage (embedding + d1 layers) and a last stage (d1 layers + final norm + output
  layer + the loss, as `pretrain_gpt.loss_func` computes it);
* the optimizer step (torch AdamW on fp32 copies of each stage's parameters, i.e. the master
  weights of mixed precision), unless ``--no-step``;
* a check: the whole model (embedding + L layers + output) in one stage, unless
  ``--no-validate``.

The costs are separated by differences, so the simulator can map them onto any number of
stages:

    layer     = (middle(d2) - middle(d1)) / (d2 - d1)
    embedding = first(d1) - middle(d1)
    output    = last(d1) - middle(d1)          (final norm, output layer and loss)
    overhead  = middle(d1) - d1 * layer        (per stage, not per layer: reported, not used)

A negative difference (timing noise on tiny shapes) is clamped to 0 and listed under
``metadata.clamped``. ``metadata.validation`` compares the whole model's measured times with
embedding + L x layer + output + overhead.

Output (``--output FILE.json``; printed when omitted): the calibration format of
`megatron.benchmarks.calibration_file`, one profile per micro-batch size in the ``layer`` +
``num_layers`` form with ``embedding`` and ``output`` entries (``step_s`` is per optimizer
step, split the same way), plus a top-level ``metadata`` object (device name, torch and
megatron-core versions, layer spec, dtype, threads, date, the command, the raw medians).

Point-to-point latency (``p2p_s``) is left out by default: the simulator then uses its
``--p2p`` flag (default 0). ``--p2p-s SECONDS`` writes a figure you measured elsewhere (for
example nccl-tests' sendrecv_perf between two GPUs of your cluster). ``--p2p loopback`` measures
a one-way transfer of one activation (seq x micro-batch x hidden elements) between two gloo
process groups over TCP on this host, per micro-batch size: what the CPU runtime's gloo
transport costs; on a GPU machine it does not measure NCCL, NVLink or PCIe.

Example command lines (CPU and GPU calibration, then a simulation that reads one): the
docstring of `tools/calibrate_stage.py`.
"""

import argparse
import datetime
import math
import os
import platform
import socket
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Literal

from megatron.benchmarks.calibration_file import (
    PassCost,
    calibration_document,
    decompose,
    predicted_whole_model,
    profile_entry,
)
from megatron.common.errors import UserError


# ----------------------------------------------------------------------------- arguments
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, no usage dump
        raise UserError(message)


def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: positive, distinct, ascending."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add = parser.add_argument
    add("--num-layers", type=int, required=True, help="layers of the whole model")
    add("--hidden-size", type=int, required=True)
    add("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    add("--num-attention-heads", type=int, required=True)
    add("--seq-length", type=int, required=True)
    add("--vocab-size", type=int, default=50304, help="(padded) vocabulary size")
    add("--micro-batch-sizes", type=int_list, default=[1], help="comma list, e.g. 1,2,4,8,16")
    add(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when torch.cuda.is_available(), else cpu",
    )
    add("--dtype", choices=["fp32", "bf16"], default=None, help="default fp32 (--bf16: bf16)")
    add("--bf16", action="store_true", help="same as --dtype bf16")
    add("--attention-dropout", type=float, default=0.1)
    add("--hidden-dropout", type=float, default=0.1)
    add("--warmup", type=int, default=2, help="untimed passes per model and micro-batch size")
    add("--repeats", type=int, default=5, help="timed passes; the median is kept")
    add(
        "--depths",
        type=int_list,
        default=None,
        help="two middle-stage depths d1,d2 for the per-layer slope (default 1,min(4,L))",
    )
    add("--no-step", action="store_true", help="do not time the optimizer step")
    add("--no-validate", action="store_true", help="do not time the whole model as a check")
    add(
        "--p2p",
        choices=["none", "loopback"],
        default="none",
        help="none: leave p2p_s out; loopback: gloo/TCP transfer on this host",
    )
    add("--p2p-s", type=float, default=None, help="write this p2p latency (seconds) instead")
    add(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="wall: perf_counter; process: this process's CPU time (CPU only; robust on a "
        "shared machine with --threads 1)",
    )
    add("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    add("--seed", type=int, default=1234)
    add("--output", metavar="FILE.json", default=None, help="default: print the JSON")
    return parser


# the model flags that must be >= 1
_POSITIVE_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")


@dataclass(frozen=True)
class CalibrationOptions:
    """The command line's settings, checked, with the defaults that depend on other flags
    filled in (dtype, depths, FFN size); built once by `from_args`, then read everywhere."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # --ffn-hidden-size, else 4 x hidden size
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    micro_batch_sizes: tuple[int, ...]  # positive, distinct, ascending
    device: Literal["auto", "cpu", "cuda"]
    dtype: Literal["fp32", "bf16"]  # --dtype, or bf16 with --bf16
    attention_dropout: float
    hidden_dropout: float
    warmup: int
    repeats: int
    depths: tuple[int, ...]  # the middle-stage depths d1[, d2]; default 1, min(4, L)
    with_step: bool  # time the optimizer step (not with --no-step)
    validate_whole_model: bool  # time the whole model as a check (not with --no-validate)
    p2p: Literal["none", "loopback"]
    p2p_s: float | None
    clock: Literal["wall", "process"]
    threads: int | None
    seed: int
    output: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CalibrationOptions":
        """The options of `build_parser`'s namespace (the one place that reads it)."""
        if args.bf16 and args.dtype == "fp32":
            raise UserError("--bf16 contradicts --dtype fp32")
        depths = args.depths
        if depths is None:
            depths = sorted({1, min(4, args.num_layers)})
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
            vocab_size=args.vocab_size,
            micro_batch_sizes=tuple(args.micro_batch_sizes),
            device=args.device,
            dtype="bf16" if args.bf16 else (args.dtype or "fp32"),
            attention_dropout=args.attention_dropout,
            hidden_dropout=args.hidden_dropout,
            warmup=args.warmup,
            repeats=args.repeats,
            depths=tuple(depths),
            with_step=not args.no_step,
            validate_whole_model=not args.no_validate,
            p2p=args.p2p,
            p2p_s=args.p2p_s,
            clock=args.clock,
            threads=args.threads,
            seed=args.seed,
            output=args.output,
        )

    def __post_init__(self) -> None:
        for flag in _POSITIVE_SIZES:
            if getattr(self, flag) < 1:
                raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise UserError("--hidden-size must be divisible by --num-attention-heads")
        if self.warmup < 0 or self.repeats < 1:
            raise UserError("--warmup must be >= 0 and --repeats >= 1")
        if self.threads is not None and self.threads < 1:
            raise UserError("--threads must be >= 1")
        if self.p2p_s is not None and (not math.isfinite(self.p2p_s) or self.p2p_s < 0):
            raise UserError("--p2p-s must be a finite number of seconds >= 0")
        if self.p2p_s is not None and self.p2p != "none":
            raise UserError("give either --p2p loopback or --p2p-s, not both")
        if self.clock == "process" and self.device == "cuda":
            raise UserError("--clock process measures CPU time: use it with --device cpu")
        if len(self.depths) > 2 or max(self.depths) > self.num_layers:
            depths = list(self.depths)  # printed as the flag's list
            raise UserError(f"--depths: one or two depths <= --num-layers, got {depths}")


def parse_args(argv=None) -> CalibrationOptions:
    """The command line, parsed and checked (a bad flag raises UserError)."""
    return CalibrationOptions.from_args(build_parser().parse_args(argv))


# ----------------------------------------------------------------------------- set-up
def pick_device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device (torch.cuda.is_available() is False)")
    return torch.device(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_argv(options: CalibrationOptions, device) -> list[str]:
    """The training code's own flags for a one-process, TP = PP = 1 run of this model (its
    parser and validation then give every other training setting its default)."""
    argv = [
        "--num-layers", str(options.num_layers),
        "--hidden-size", str(options.hidden_size),
        "--ffn-hidden-size", str(options.ffn_hidden_size),
        "--num-attention-heads", str(options.num_attention_heads),
        "--seq-length", str(options.seq_length),
        "--attention-dropout", str(options.attention_dropout),
        "--hidden-dropout", str(options.hidden_dropout),
        "--seed", str(options.seed),
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",  # (not used)
        "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(options.vocab_size),
        "--distributed-backend", "nccl" if device.type == "cuda" else "gloo",
        "--distributed-timeout-minutes", "5",
    ]  # fmt: skip
    if options.dtype == "bf16":
        argv.append("--bf16")
    return argv


def initialize_single_process(device, options: CalibrationOptions):
    """torch.distributed with world size 1 and parallel_state with TP = PP = 1, through the
    training code's own `initialize_distributed`; returns (device, TransformerConfig).

    Megatron's own flag namespace (`megatron_args`) is built and used here only: the training
    functions below take it."""
    import torch.distributed as dist

    from megatron.model.build import transformer_config
    from megatron.training.arguments import build_parser, validate_args
    from megatron.training.config import RunConfig
    from megatron.training.training import initialize_distributed

    if not dist.is_initialized():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
    flags = build_parser().parse_args(_megatron_argv(options, device))
    validate_args(flags, world_size=1)
    run = RunConfig.from_args(flags)
    device = initialize_distributed(run)
    return device, transformer_config(run, device)


def build_stage(config, kind: str, depth: int, options: CalibrationOptions, device):
    """A GPT stage with `depth` layers: 'first' (embedding), 'middle', 'last' (output + loss)
    or 'whole' (both ends, the one-stage model)."""
    from megatron.model.gpt import StageLayout, build_gpt_stage

    pre, post = {"first": (1, 0), "middle": (0, 0), "last": (0, 1), "whole": (1, 1)}[kind]
    # A layout that puts this chunk where `kind` says (rank, size only decide pre/post and
    # the initialization's global layer names); the config gets `depth` layers and PP = 1.
    size = 1 if kind == "whole" else 3
    rank = 0 if pre else (size - 1 if post else 1)
    layout = StageLayout(
        pipeline_rank=rank,
        pipeline_size=size,
        tensor_rank=0,
        tensor_size=1,
        num_layers=depth * size,
    )
    model = build_gpt_stage(
        replace(config, num_layers=depth),
        layout,
        vocab_size=options.vocab_size,
        max_sequence_length=options.seq_length,
        position_embedding_type="learned_absolute",
        device=device,
        seed=options.seed,
    )
    if len(model.decoder.layers) != depth:
        raise RuntimeError(f"built {len(model.decoder.layers)} layers, wanted {depth}")
    model.train()
    return model


def layer_spec_name(device) -> str:
    from megatron.model.gpt import transformer_engine_available

    if device.type == "cuda" and transformer_engine_available():
        return "transformer_engine"
    return "portable_sdpa"


# ----------------------------------------------------------------------------- timing
_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(kind: str, mbs: int, options: CalibrationOptions, device, torch_dtype, generator):
    import torch

    pre, post = kind in ("first", "whole"), kind in ("last", "whole")
    s, h = options.seq_length, options.hidden_size
    tokens = positions = labels = hidden = None
    if pre:
        tokens = torch.randint(0, options.vocab_size, (mbs, s), generator=generator).to(device)
        positions = torch.arange(s, device=device).unsqueeze(0).expand(mbs, s)
    else:
        hidden = torch.randn(s, mbs, h, generator=generator).to(device, torch_dtype)
        hidden.requires_grad_(True)
    if post:
        labels = torch.randint(0, options.vocab_size, (mbs, s), generator=generator).to(device)
    return tokens, positions, labels, hidden


def one_pass(
    model, kind: str, mbs: int, options: CalibrationOptions, device, torch_dtype, generator, clock
):
    """(forward, backward) seconds of one microbatch through `model`."""
    import torch

    post = kind in ("last", "whole")
    tokens, positions, labels, hidden = _inputs(kind, mbs, options, device, torch_dtype, generator)
    grad = None
    if not post:
        grad = torch.randn(options.seq_length, mbs, options.hidden_size, generator=generator)
        grad = grad.to(device, torch_dtype)
    if hidden is not None:
        model.set_input_tensor(hidden)
    _sync(device)
    start = clock()
    output = model(tokens, positions, None, labels=labels)
    if post:  # pretrain_gpt.loss_func: mean per-token loss over the (all-ones) mask
        output = output.float().view(-1).sum() / output.numel()
    _sync(device)
    middle = clock()
    if post:
        output.backward()
    else:
        output.backward(grad)
    _sync(device)
    end = clock()
    return middle - start, end - middle


def time_passes(
    models: dict, kinds: dict, mbs: int, options: CalibrationOptions, device, torch_dtype
) -> dict:
    """Median forward and backward seconds per model. The models take turns pass by pass, so
    that a change in the machine's load hits all of them alike (their differences are what
    count)."""
    import torch

    generator = torch.Generator().manual_seed(options.seed + mbs)
    clock = _CLOCKS[options.clock]
    samples = {name: ([], []) for name in models}
    for i in range(options.warmup + options.repeats):
        for name, model in models.items():
            f, b = one_pass(model, kinds[name], mbs, options, device, torch_dtype, generator, clock)
            if i >= options.warmup:
                samples[name][0].append(f)
                samples[name][1].append(b)
    return {
        name: PassCost(statistics.median(f), statistics.median(b))
        for name, (f, b) in samples.items()
    }


def time_optimizer_step(model, options: CalibrationOptions, device) -> float:
    """Median seconds of one AdamW step over fp32 copies of the stage's parameters."""
    import torch

    params = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    clock = _CLOCKS[options.clock]
    times = []
    for i in range(options.warmup + options.repeats):
        _sync(device)
        start = clock()
        optimizer.step()
        _sync(device)
        if i >= options.warmup:
            times.append(clock() - start)
    del optimizer, params
    return statistics.median(times)


def loopback_p2p_seconds(num_bytes: int, repeats: int, warmup: int) -> float:
    """One-way time of a `num_bytes` transfer between two gloo groups over TCP on this host
    (ping-pong between two threads, half the round trip, median)."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    groups = [None, None]

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("loopback", store), rank, 2)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rounds = warmup + repeats
    payload = torch.ones(num_bytes, dtype=torch.uint8)

    def echo():
        buffer = torch.empty_like(payload)
        for _ in range(rounds):
            groups[1].recv([buffer], 0, 0).wait()
            groups[1].send([buffer], 0, 1).wait()

    peer = threading.Thread(target=echo, daemon=True)
    peer.start()
    buffer = torch.empty_like(payload)
    times = []
    for i in range(rounds):
        start = time.perf_counter()
        groups[0].send([payload], 1, 0).wait()
        groups[0].recv([buffer], 1, 1).wait()
        if i >= warmup:
            times.append((time.perf_counter() - start) / 2)
    peer.join()
    return statistics.median(times)


# ----------------------------------------------------------------------------- the run
def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict:
    from importlib import metadata

    versions = {}
    for package in ("torch", "megatron-core", "transformer-engine"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _ms(cost: PassCost) -> str:
    return f"F {cost.forward_s * 1e3:9.3f} B {cost.backward_s * 1e3:9.3f} ms"


def _validation(whole: PassCost, predicted: PassCost) -> dict:
    """The whole model's measured times against the sum of its parts."""
    return {
        "measured_forward_s": whole.forward_s,
        "measured_backward_s": whole.backward_s,
        "predicted_forward_s": predicted.forward_s,
        "predicted_backward_s": predicted.backward_s,
        "forward_error": predicted.forward_s / whole.forward_s - 1.0,
        "backward_error": predicted.backward_s / whole.backward_s - 1.0,
    }


def _is_out_of_memory(error: BaseException) -> bool:
    return "out of memory" in str(error).lower()


class _Collected:
    """What the micro-batch sizes measured so far add up to (profiles and metadata parts)."""

    def __init__(self):
        self.profiles, self.raw, self.validation, self.overheads = [], {}, {}, {}
        self.clamped, self.skipped = [], []


def _stage_specs(options: CalibrationOptions) -> dict[str, tuple[str, int]]:
    """The stages to time: name -> (kind, depth); ``whole`` is the one-stage model (a check)."""
    d1, d2 = options.depths[0], options.depths[-1]
    specs = {"middle_d1": ("middle", d1), "first": ("first", d1), "last": ("last", d1)}
    if d2 > d1:
        specs["middle_d2"] = ("middle", d2)
    if options.validate_whole_model:
        specs["whole"] = ("whole", options.num_layers)
    return specs


def _time_size(
    mbs, models, specs, step_s, options: CalibrationOptions, device, torch_dtype
) -> dict | None:
    """Every stage's median costs at micro-batch size `mbs` (None: out of memory)."""
    import torch

    try:
        kinds = {name: kind for name, (kind, _) in specs.items()}
        measured = time_passes(models, kinds, mbs, options, device, torch_dtype)
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is one
        if not _is_out_of_memory(error) and not isinstance(error, MemoryError):
            raise
        print(f"  micro-batch {mbs}: out of memory, skipped", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    for name in measured:
        measured[name] = PassCost(*measured[name].values()[:2], step_s.get(name, 0.0))
    if "middle_d2" not in measured:
        measured["middle_d2"] = measured["middle_d1"]
    return measured


def _add_profile(
    collected: _Collected, mbs: int, measured: dict, options: CalibrationOptions
) -> None:
    """Decompose one micro-batch size's timings into a profile and print its line."""
    parts, notes = decompose(measured, list(options.depths))
    collected.clamped += [f"micro-batch {mbs}: {note}" for note in notes]
    p2p = None
    if options.p2p == "loopback":
        element = 2 if options.dtype == "bf16" else 4
        num_bytes = options.seq_length * mbs * options.hidden_size * element
        p2p = loopback_p2p_seconds(num_bytes, options.repeats, max(options.warmup, 1))
    collected.profiles.append(
        profile_entry(mbs, parts, options.num_layers, with_step=options.with_step, p2p_s=p2p)
    )
    collected.raw[str(mbs)] = {name: asdict(cost) for name, cost in measured.items()}
    collected.overheads[str(mbs)] = asdict(parts["stage_overhead"])
    line = (
        f"  micro-batch {mbs:>3}: layer {_ms(parts['layer'])} | embedding "
        f"{_ms(parts['embedding'])} | output+loss {_ms(parts['output'])}"
    )
    if "whole" in measured:
        predicted = predicted_whole_model(parts, options.num_layers)
        collected.validation[str(mbs)] = _validation(measured["whole"], predicted)
        line += f" | whole model {_ms(measured['whole'])} (parts {_ms(predicted)})"
    if p2p is not None:
        line += f" | p2p {p2p * 1e3:.3f} ms"
    print(line, flush=True)


def measure(options: CalibrationOptions) -> dict:
    """Build the stages, time them at every micro-batch size, return the calibration object."""
    import torch

    warnings.filterwarnings("ignore")
    if options.threads:
        torch.set_num_threads(options.threads)
    device, config = initialize_single_process(pick_device(options.device), options)
    torch_dtype = torch.bfloat16 if options.dtype == "bf16" else torch.float32
    specs = _stage_specs(options)
    models = {
        name: build_stage(config, kind, depth, options, device)
        for name, (kind, depth) in specs.items()
    }
    step_s = {}
    if options.with_step:
        step_s = {
            name: time_optimizer_step(model, options, device) for name, model in models.items()
        }
    spec = layer_spec_name(device)
    d1, d2 = options.depths[0], options.depths[-1]
    print(
        f"> calibrating on {device_name(device)} ({device.type}), {options.dtype}, layer spec "
        f"{spec}, threads {torch.get_num_threads()}, {options.clock} clock; warmup "
        f"{options.warmup}, repeats {options.repeats}, depths {d1},{d2}",
        flush=True,
    )
    collected = _Collected()
    for mbs in options.micro_batch_sizes:
        measured = _time_size(mbs, models, specs, step_s, options, device, torch_dtype)
        if measured is None:
            collected.skipped.append(mbs)
        else:
            _add_profile(collected, mbs, measured, options)
    if not collected.profiles:
        raise UserError("no micro-batch size could be measured (out of memory)")
    if options.with_step:
        s = collected.profiles[0]["layer"]["step_s"]
        print(
            f"  optimizer step (AdamW, fp32 master weights): {s * 1e3:.3f} ms per layer", flush=True
        )
    return calibration_document(
        model=_model_shape(options),
        device_type=device.type,
        profiles=collected.profiles,
        metadata=_metadata(options, collected, device, spec),
        p2p_s=options.p2p_s,
    )


def _model_shape(options: CalibrationOptions) -> dict:
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
            "vocab_size")  # fmt: skip
    return {key: getattr(options, key) for key in keys}


def _metadata(options: CalibrationOptions, collected: _Collected, device, spec: str) -> dict:
    import torch

    return {
        "tool": "tools/calibrate_stage.py",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": device_name(device),
        "versions": _versions(),
        "layer_spec": spec,
        "dtype": options.dtype,
        "threads": torch.get_num_threads(),
        "warmup": options.warmup,
        "repeats": options.repeats,
        "statistic": "median",
        "clock": options.clock,
        "depths": [options.depths[0], options.depths[-1]],
        "dropout": {"attention": options.attention_dropout, "hidden": options.hidden_dropout},
        "method": "layer = (middle(d2) - middle(d1)) / (d2 - d1); embedding = first(d1) - "
        "middle(d1); output = last(d1) - middle(d1) (final norm + output layer + loss); "
        "step_s: AdamW on fp32 copies of the parameters, split the same way",
        "stage_overhead": collected.overheads,
        "validation": collected.validation,
        "clamped": collected.clamped,
        "skipped_micro_batch_sizes": collected.skipped,
        "p2p": (
            "loopback: gloo over TCP on this host, one-way, per profile"
            if options.p2p == "loopback"
            else ("given with --p2p-s" if options.p2p_s is not None else "not measured")
        ),
        "measured": collected.raw,
    }


def shutdown() -> None:
    if "torch" not in sys.modules:
        return
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
