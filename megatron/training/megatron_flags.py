"""Megatron-LM flags that we accept without implementing them, and the check that says so.

Two tables, both listed in docs/megatron_flags.md:

* `OUR_BEHAVIOUR`: flags whose effect is already what this implementation does (for example
  `--use-mcore-models`: the model is always megatron-core's), or that only change speed and
  never the numbers, the memory or the parallel layout. Accepted and documented.
* `NOT_SUPPORTED` (and `NOT_YET`, the long tail of Megatron's parser by its groups): features
  we do not have yet. They parse, so a Megatron command line is
  read completely, but any value other than the default fails validation with one line:
  `--foo is not supported yet`. Flags that take a value and support some of its values list
  the supported ones; anything else fails the same way naming the value.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron.common.errors import UserError


@dataclass(frozen=True)
class Flag:
    """How a compatibility flag parses: a switch (no value) or a value of `type`."""

    name: str
    type: type | None = None  # None: a store_true switch
    default: object = None
    nargs: str | None = None
    supported: tuple | None = ()  # values accepted besides the default; None: any value

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def _switches(*names: str) -> list[Flag]:
    return [Flag(name) for name in names]


# Accepted: our behaviour already, or speed-only (see the docs table for each one's reason).
OUR_BEHAVIOUR = [
    *_switches(
        "--use-mcore-models",
        "--use-same-sampling-seed-across-dp-ranks",  # inference's sampling seed
        "--no-gradient-accumulation-fusion",
        "--no-rope-fusion",
        "--no-persist-layer-norm",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--manual-gc",
        "--async-save",
        "--use-persistent-ckpt-worker",
        "--dist-ckpt-optim-fully-reshardable",
        "--ckpt-fully-parallel-load",
        "--ckpt-fully-parallel-save",
        "--no-ckpt-fully-parallel-save",
        "--ckpt-assume-constant-structure",
        "--async-ckpt-use-cpu-shm",
        "--apply-query-key-layer-scaling",
        "--attention-softmax-in-fp32",
        "--overlap-p2p-communication-warmup-flush",
        "--use-flash-attn",
        "--no-bias-swiglu-fusion",
        "--disable-jit-fuser",
        "--use-cpu-initialization",
        "--ddp-pad-buckets-for-high-nccl-busbw",
        "--no-align-grad-reduce",
        "--disable-align-grad-reduce",
        "--no-align-param-gather",
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        "--no-pin-cpu-grads",
        "--no-pin-cpu-params",
    ),
    Flag("--local-rank", int, None, supported=None),
    Flag("--dist-ckpt-workers", int, 1, supported=None),
    Flag("--async-ckpt-cpu-priority", int, None, supported=None),
    Flag("--async-ckpt-io-priority", int, None, supported=None),
    Flag("--manual-gc-interval", int, 0, supported=None),
    Flag("--num-dataset-builder-threads", int, 1, supported=None),
    Flag("--tensorboard-queue-size", int, 1000, supported=None),
    Flag("--head-lr-mult", float, 1.0, supported=None),
    Flag("--transformer-impl", str, "transformer_engine", supported=("local",)),
    Flag("--attention-backend", str, "auto", supported=("flash", "fused", "unfused", "local")),
    Flag("--async-strategy", str, "nvrx", supported=None),
    Flag("--num-workers", int, 2, supported=None),
    Flag("--empty-unused-memory-level", int, 0, supported=(1, 2)),
    Flag("--timing-log-level", int, 0),
]

# Parsed, rejected at validation unless left at the default.
NOT_SUPPORTED = [
    # mixed precision and low precision
    *_switches("--fp8-param-gather", "--grad-reduce-in-bf16"),
    Flag("--fp8-format", str),
    Flag("--fp8-recipe", str),
    Flag("--fp8-amax-history-len", int),
    Flag("--fp8-amax-compute-algo", str),
    # overlap
    *_switches("--tp-comm-overlap"),
    Flag("--tp-comm-overlap-cfg", str),
    # optimizer and batch schedule variants
    # checkpoints, fault tolerance, testing hooks
    Flag("--export-te-mcore-model"),
    Flag("--export-kd-teacher-load", str),
    Flag("--export-kd-cfg", str),
    # logging and profiling outside this process
    Flag("--profile"),
    Flag("--profile-step-start", int, 10),
    Flag("--profile-step-end", int, 12),
]

# The rest of Megatron-LM's pretraining parser, by Megatron's own argparse group (the long
# tail; tools/data/megatron_pretraining_flags.json has the whole parser's in-scope list). Each
# parses as in Megatron, so a Megatron command line is read completely; any use fails
# validation with `--flag is not supported yet`. A name ending in `=` takes one value, `=*`
# any number; a bare name is a switch.
NOT_YET_BY_GROUP = {
    "transformer configuration": (
        "--tensor-parallel-num-weight-shards= --pipeline-model-parallel-comm-backend= "
        "--max-seqlen-per-dp-cp-rank= --no-initialization --no-tp-comm-bulk-wgrad "
        "--disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad "
        "--no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag --no-tp-comm-overlap-rs "
        "--disable-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag "
        "--disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs "
        "--tp-comm-bootstrap-backend= --delay-wgrad-compute "
        "--ep-overlap-early-attn-memory-release --use-ring-exchange-p2p "
        "--cpu-offloading-num-layers= --cpu-offloading-retain-pinned-cpu-buffers "
        "--flash-attention-version= --softmax-type= --fp32-residual-connection "
        "--glu-linear-offset= --activation-func-clamp-value= --qk-l2-norm --qk-clip "
        "--qk-clip-alpha= --qk-clip-threshold= --dsa-indexer-topk-freq= "
        "--dsa-indexer-skip-topk-offset= --dsa-kernel-backend= "
        "--dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation "
        "--disable-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu "
        "--disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon= "
        "--dsa-indexer-k-norm-fp32 --embedding-init-method-std= --init-model-with-meta-device "
        "--mup-width-mult= "
        "--disable-bf16-reduced-precision-matmul "
        "--use-fused-weighted-squared-relu --fused-residual-rmsnorm "
        "--use-transformer-engine-op-fuser --distribute-saved-activations "
        "--fp8-quantizer-factory= --fp8-margin= --fp8-interval= --no-fp8-wgrad "
        "--disable-fp8-wgrad --fp8-output-proj --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16= --num-layers-at-end-in-bf16= --use-kitchen-attention "
        "--kitchen-attention-backend= --fp4-format= --fp4-recipe= --fp4-quantizer-factory= "
        "--high-priority-a2a-comm-stream --use-grouped-gemm-for-dense-mlp "
        "--gtp-remat-opt-in-modules=* --enable-mhc-connections --mhc-num-residual-streams= "
        "--mhc-sinkhorn-iterations= --mhc-init-gating-factor= --mhc-recompute-layer-num= "
        "--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding "
        "--config-logger-dir= --flash-decode --batch-invariant-mode --batch-invariant-backend= "
        "--use-te-activation-func --symmetric-ar-type= --nccl-all-reduce-for-prefill "
        "--mrope-section=* --gdp-num-householder= --gdp-cutedsl-kernel "
        "--gdp-num-chunk-states-to-recompute= --mlp-chunks-for-prefill= "
        "--mlp-chunks-for-training= --fine-grained-activation-offloading --offload-modules=* "
        "--min-offloaded-tensor-size= --delta-offload-bytes-across-pp-ranks= "
        "--activation-offload-fraction= --fine-grained-offloading-max-inflight-offloads= "
    ),
    "network size": (
        "--encoder-num-layers= --decoder-num-layers= --window-size= --window-attn-skip-freq= "
        "--relative-attention-num-buckets= --relative-attention-max-distance= --no-rope-freq= "
        "--quick-geglu --onnx-safe= "
    ),
    "regularization": ("--muon-use-syrk --no-weight-decay-cond-type= "),
    "profiling": (
        "--use-pytorch-profiler --pytorch-profiler-collect-shapes "
        "--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra --profile-ranks=* "
        "--record-memory-history --memory-snapshot-path= --record-shapes --nvtx-ranges "
    ),
    "training": (
        "--decrease-batch-size-if-needed --gpu-sniff-test-interval= --train-sync-interval= "
        "--exit-signal= --exit-signal-handler-for-dataloader --exit-signal-handler-for-training "
        "--iterations-to-skip=* --optimizer-cpu-offload "
        "--optimizer-offload-fraction= --use-torch-optimizer-for-cpu-offload "
        "--overlap-cpu-optimizer-d2h-h2d --dump-param-to-param-group-map= "
    ),
    "RNG and initialization": ("--te-rng-tracker --data-parallel-random-init "),
    "learning rate and weight decay": (
        "--lr-wsd-decay-style= --lr-wsd-decay-iters= --lr-wsd-decay-samples= "
        "--start-weight-decay= --end-weight-decay= --weight-decay-incr-style= --freeze-all-layers "
    ),
    "checkpointing": (
        "--persistent-save-interval= --save-params-interval= --save-activations-interval= "
        "--save-wgrads-interval= --save-dgrads-interval= --load-main-params-from-ckpt "
        "--non-persistent-save-interval= --non-persistent-ckpt-type= "
        "--non-persistent-global-ckpt-dir= --non-persistent-local-ckpt-dir= "
        "--non-persistent-local-ckpt-algo= --pretrained-checkpoint= "
        "--use-checkpoint-args --use-mp-args-from-checkpoint-args "
        "--no-use-tokenizer-model-from-checkpoint-args "
        "--disable-use-tokenizer-model-from-checkpoint-args --exit-on-missing-checkpoint "
        "--ckpt-convert-format= --ckpt-convert-save= --ckpt-convert-update-legacy-dist-opt-format "
        "--ckpt-fully-parallel-load-exchange-algo= --ckpt-fully-parallel-load-per-rank-objects "
        "--ckpt-fully-parallel-save-process-group= --ckpt-fully-parallel-load-process-group= "
        "--ckpt-pg-tensors-cache-path= --ckpt-pg-tensors-cache-create "
        "--no-ckpt-load-validate-sharding-integrity "
        "--disable-ckpt-load-validate-sharding-integrity --dist-ckpt-save-pre-mcore-014 "
        "--distrib-optim-fully-reshardable-mem-efficient --no-save-tokenizer-assets "
        "--disable-save-tokenizer-assets --replication --replication-jump= --replication-factor= "
        "--override-ckpt-iteration= --ckpt-drop-redundant-extra-state "
    ),
    "mixed precision": (
        "--fp16-lm-cross-entropy --output-logit-dtype= --reuse-grad-buf-for-mxfp8-param-ag "
    ),
    "distributed init": (
        "--lazy-mpu-init --nccl-communicator-config-path= --use-sharp --sharp-enabled-group= "
        "--high-priority-stream-groups=* --distributed-timeout-seconds-after-init= "
        "--flight-recorder-dump-path= --flight-recorder-trace-buffer-size= "
        "--no-flight-recorder-dump-on-timeout --disable-flight-recorder-dump-on-timeout "
        "--flight-recorder-include-stack-trace --no-flight-recorder-include-only-active "
        "--disable-flight-recorder-include-only-active --no-flight-recorder-extra-dump-on-exec "
        "--disable-flight-recorder-extra-dump-on-exec --no-overlap-p2p-communication "
        "--ddp-reduce-scatter-with-fp32-accumulation "
        "--gtp-remat-reduce-scatter-with-fp32-accumulation "
        "--ddp-param-name-patterns-for-fp32-local-accumulation=* "
        "--use-nccl-ub --disable-symmetric-registration --gtp-remat-nccl-ub "
        "--create-all-gather-group --no-gradient-reduce-div-fusion "
        "--suggested-communication-unit-size= --keep-fp8-transpose-cache "
        "--enable-full-sharding-in-hsdp --fake-process-group "
    ),
    "validation": (
        "--start-eval-at-iter= --full-validation "
        "--multiple-validation-sets --validation-set-names=* "
    ),
    "data and dataloader": (
        "--phase-transition-iterations= --per-dataset-sequences-path= "
        "--dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --encoder-seq-length= "
        "--decoder-seq-length= --sample-rate= --mask-prob= --short-seq-prob= "
        "--dataloader-inter-document-masking --object-storage-cache-path= "
        "--mid-level-dataset-surplus= --allow-ambiguous-pad-tokens "
    ),
    "tokenizer": (
        "--padded-vocab-size= --no-pad-vocab-size --disable-pad-vocab-size --vocab-extra-ids= "
        "--tokenizer-metadata= "
        "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
        "--tokenizer-hf-no-include-special-tokens --trust-remote-code --null-tokenizer-eod-id= "
        "--null-tokenizer-pad-id= --chat-template= --use-gigatoken "
    ),
    "autoresume": ("--adlr-autoresume --adlr-autoresume-interval= "),
    "mla": ("--cache-mla-latents " "--mla-down-proj-fusion "),
    "heterogeneous architecture": (
        "--heterogeneous-layers-config-path= --heterogeneous-layers-config-encoded-json= "
    ),
    "logging": (
        "--log-progress --timing-log-option= --tensorboard-log-interval= "
        "--no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard "
        "--log-memory-interval= --log-device-memory-used --log-max-attention-logit "
        "--no-barrier-with-level-1-timing --log-world-size-to-tensorboard "
        "--log-energy "
    ),
    "opentelemetry": ("--otel-enabled --otel-service-name= --otel-span-groups= "),
    "Logits Distillation": (
        "--logits-save-top-k= --logits-save-top-p= --logits-save-top-p-min-k= --logits-save-dir= "
        "--logits-save-dtype= --logits-load-dir= --logits-load-decode-threads= "
        "--logits-load-prefetch-factor= --logits-load-msc-prefetch-depth= "
        "--logits-load-kd-loss-alpha= --logits-load-ignore-errors "
    ),
    "straggler": (
        "--log-straggler --straggler-ctrlr-port= --straggler-minmax-count= "
        "--disable-straggler-on-startup "
    ),
    "workload inspector": ("--run-workload-inspector-server "),
    "Transformer-Engine": ("--fp4-param-gather --te-precision-config-file= "),
    "experimental": ("--spec=* --yaml-cfg=  " "    "),
    "one logger": (
        "--no-one-logger --one-logger-project= --one-logger-run-name= --one-logger-async "
        "--app-tag-run-name= --app-tag-run-version= "
    ),
    "In-process restart": (
        "--inprocess-restart --inprocess-max-iterations= --inprocess-monitor-thread-interval= "
        "--inprocess-monitor-process-interval= --inprocess-progress-watchdog-interval= "
        "--inprocess-heartbeat-interval= --inprocess-soft-timeout= --inprocess-hard-timeout= "
        "--inprocess-heartbeat-timeout= --inprocess-barrier-timeout= "
        "--inprocess-completion-timeout= --inprocess-last-call-wait= "
        "--inprocess-termination-grace-time= --inprocess-granularity= "
        "--inprocess-active-world-size= --inprocess-empty-cuda-cache "
    ),
    "ft_package": ("--enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters= "),
    "msc": ("--enable-msc --disable-msc "),
    "sft": ("--sft --sft-tokenizer-prompt-format= "),
    "fault injector": (
        "--fault-injector-ranks= --fault-injector-num-ranks= --fault-injector-fault-types= "
        "--fault-injector-fault-probabilities= --fault-injector-fault-delay= "
        "--fault-injector-delay-start-iteration= --fault-injector-mtti-seconds= "
        "--fault-injector-offset-seconds= --fault-injector-seed= "
    ),
}


def not_yet_specs() -> list[tuple[str, str]]:
    """(flag, kind) for every entry: kind `switch`, `value` or `values`."""
    specs = []
    for names in NOT_YET_BY_GROUP.values():
        for name in names.split():
            if name.endswith("=*"):
                specs.append((name[:-2], "values"))
            elif name.endswith("="):
                specs.append((name[:-1], "value"))
            else:
                specs.append((name, "switch"))
    return specs


NOT_YET = [
    Flag(name) if kind == "switch" else Flag(name, str, nargs="*" if kind == "values" else None)
    for name, kind in not_yet_specs()
]

# Megatron's deprecated spellings, refused with Megatron's own message.
DEPRECATED = {
    "--batch-size": (
        int,
        "--batch-size argument is no longer valid, use --micro-batch-size instead",
    ),
    "--warmup": (int, "--warmup argument is no longer valid, use --lr-warmup-fraction instead"),
    "--model-parallel-size": (
        int,
        "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead",
    ),
    "--checkpoint-activations": (
        None,
        "--checkpoint-activations is no longer valid, use --recompute-activations, or, for "
        "more control, --recompute-granularity and --recompute-method.",
    ),
}
# Deprecated and without effect in Megatron too: accepted, with Megatron's notice.
NO_EFFECT = {
    "--use-dist-ckpt": (
        None,
        "--use-dist-ckpt is deprecated and has no effect. Use --ckpt-format to select the "
        "checkpoint format.",
    ),
    "--dist-ckpt-format": (
        str,
        "--dist-ckpt-format is deprecated and has no effect. Use --ckpt-format to select the "
        "checkpoint format.",
    ),
}

# Not supported yet because they need a GPU (CUDA kernels, streams or graphs, Transformer
# Engine): the one-line refusal says so. By prefix: every flag that starts with it.
GPU_ONLY = {
    "--fp8": "FP8 needs Transformer Engine on a Hopper or newer GPU",
    "--tp-comm-overlap": "Transformer Engine's userbuffers overlap of tensor-parallel comms",
    "--cuda-graph": "CUDA graphs",
    "--use-transformer-engine-op-fuser": "Transformer Engine's fused operations",
    "--fine-grained-activation-offloading": "activations offloaded to host memory on CUDA streams",
    "--offload-modules": "activations offloaded to host memory on CUDA streams",
    "--delay-wgrad-compute": "Transformer Engine's delayed weight-gradient GEMMs",
}
# CUDA graphs (Megatron's TransformerConfig fields), parsed so that such a command line reads
# completely and is refused in one line
CUDA_GRAPH_FLAGS = [
    Flag("--cuda-graph-impl", str, "none"),
    Flag("--cuda-graph-modules", str, nargs="*"),
    Flag("--cuda-graph-warmup-steps", int, 3, supported=None),
]


def gpu_only_reason(flag: str) -> str | None:
    return next((why for prefix, why in GPU_ONLY.items() if flag.startswith(prefix)), None)


def not_supported_message(flag: str) -> str:
    """`--foo is not supported yet`, with why where it needs a GPU."""
    why = gpu_only_reason(flag)
    return f"{flag} is not supported yet" + (f" (GPU-only: {why})" if why else "")


# Value flags whose other values are other features (`--ckpt-format torch_dcp`: another
# checkpoint format). These are parsed in arguments.py.
VALUE_NOT_SUPPORTED = {
    "--ckpt-format": ("torch_dist", "torch", "fsdp_dtensor"),
    "--experimental-attention-variant": (None, "gated_delta_net", "dsa"),
}


def add_compatibility_flags(parser: argparse.ArgumentParser) -> None:
    deprecated = [Flag(name, kind) for name, (kind, _) in {**DEPRECATED, **NO_EFFECT}.items()]
    for title, flags in (("Megatron flags: our behaviour", OUR_BEHAVIOUR),
                         ("Megatron flags: not supported yet",
                          NOT_SUPPORTED + NOT_YET + CUDA_GRAPH_FLAGS),
                         ("Megatron flags: deprecated", deprecated)):  # fmt: skip
        add = parser.add_argument_group(title).add_argument
        for flag in flags:
            if flag.type is None:
                add(flag.name, action="store_true", help=argparse.SUPPRESS)
            else:
                add(flag.name, type=flag.type, default=flag.default, nargs=flag.nargs,
                    help=argparse.SUPPRESS)  # fmt: skip


def _rejected_value(flag: Flag, value) -> bool:
    default = False if flag.type is None else flag.default
    if flag.supported is None:
        return False
    return value != default and value not in flag.supported


def unsupported_flags(args: argparse.Namespace) -> list[str]:
    """`--foo` (or `--foo VALUE`) for every flag set to something we do not implement."""
    found = []
    for flag in OUR_BEHAVIOUR:
        value = getattr(args, flag.dest)
        if flag.type is not None and _rejected_value(flag, value):
            found.append(f"{flag.name} {value}")
    for flag in NOT_SUPPORTED + NOT_YET + CUDA_GRAPH_FLAGS:
        if _rejected_value(flag, getattr(args, flag.dest)):
            found.append(flag.name)
    for name, supported in VALUE_NOT_SUPPORTED.items():
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        if value not in supported:
            found.append(f"{name} {value}")
    return found


def apply_megatron_fallbacks(args: argparse.Namespace) -> None:
    """What Megatron turns off rather than refuses: --sequence-parallel without tensor
    parallelism (the sequence is then not split: nothing changes), with Megatron's warning."""
    if getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size == 1:
        if os.environ.get("RANK", "0") == "0":
            print(
                "WARNING: Disabling sequence parallelism because tensor model parallelism is "
                "disabled",
                flush=True,
            )
        args.sequence_parallel = False


def _given(args: argparse.Namespace, name: str) -> bool:
    value = getattr(args, name.lstrip("-").replace("-", "_"))
    return value is not None and value is not False


def reject_deprecated_flags(args: argparse.Namespace) -> None:
    """Megatron's answer to its deprecated spellings: an error, or a notice and no effect."""
    for name, (_, message) in DEPRECATED.items():
        if _given(args, name):
            raise UserError(message)
    for name, (_, message) in NO_EFFECT.items():
        if _given(args, name) and os.environ.get("RANK", "0") == "0":
            print(message, flush=True)


def reject_unsupported_flags(args: argparse.Namespace) -> None:
    reject_deprecated_flags(args)
    apply_megatron_fallbacks(args)
    found = unsupported_flags(args)
    if found:
        raise UserError(not_supported_message(found[0]))
