"""Megatron-LM pretraining flags that are not supported yet, listed by Megatron's own argparse
group (the long tail of its parser; tools/data/megatron_pretraining_flags.json has the whole
parser's in-scope list).

Each parses as in Megatron (a switch, one value, or several), so a Megatron command line is
read completely; any use of one fails validation with `--flag is not supported yet`. Flags we
implement, accept as our behaviour, or reject with a better message are in
megatron_flags.py and arguments.py instead. A name ending in `=` takes one value, `=*` any
number; a bare name is a switch.
"""

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
        "--dsa-indexer-skip-topk-offset= --dsa-indexer-use-sparse-loss --dsa-kernel-backend= "
        "--dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation "
        "--disable-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu "
        "--disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon= "
        "--dsa-indexer-k-norm-fp32 --embedding-init-method-std= --init-model-with-meta-device "
        "--mup-width-mult= --mup-embedding-mult= --mup-output-mult= --mup-base-head-dim= "
        "--mup-attn-scale-power= --disable-bf16-reduced-precision-matmul "
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
        "--yarn-original-max-position-embeddings= --yarn-beta-fast= --yarn-beta-slow= "
        "--yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int "
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
        "--iterations-to-skip=* --no-check-for-nan-in-loss-and-grad --check-for-large-grads "
        "--result-rejected-tracker-filename= --rope-type= --optimizer-cpu-offload "
        "--optimizer-offload-fraction= --use-torch-optimizer-for-cpu-offload "
        "--overlap-cpu-optimizer-d2h-h2d --dump-param-to-param-group-map= "
    ),
    "RNG and initialization": ("--te-rng-tracker --data-parallel-random-init "),
    "learning rate and weight decay": (
        "--lr-wsd-decay-style= --lr-wsd-decay-iters= --lr-wsd-decay-samples= --lr-warmup-init= "
        "--start-weight-decay= --end-weight-decay= --weight-decay-incr-style= --freeze-all-layers "
    ),
    "checkpointing": (
        "--persistent-save-interval= --save-params-interval= --save-activations-interval= "
        "--save-wgrads-interval= --save-dgrads-interval= --load-main-params-from-ckpt "
        "--non-persistent-save-interval= --non-persistent-ckpt-type= "
        "--non-persistent-global-ckpt-dir= --non-persistent-local-ckpt-dir= "
        "--non-persistent-local-ckpt-algo= --pretrained-checkpoint= --ckpt-step= "
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
        "--ddp-param-name-patterns-for-fp32-local-accumulation=* --no-use-layer-wise-param-layout "
        "--use-nccl-ub --disable-symmetric-registration --gtp-remat-nccl-ub "
        "--create-all-gather-group --outer-dp-sharding-strategy= --no-gradient-reduce-div-fusion "
        "--suggested-communication-unit-size= --keep-fp8-transpose-cache "
        "--enable-full-sharding-in-hsdp --fake-process-group "
    ),
    "validation": (
        "--start-eval-at-iter= --eval-micro-batch-size= --full-validation "
        "--multiple-validation-sets --validation-set-names=* "
    ),
    "data and dataloader": (
        "--phase-transition-iterations= --per-dataset-sequences-path= "
        "--dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --encoder-seq-length= "
        "--decoder-seq-length= --sample-rate= --mask-prob= --short-seq-prob= "
        "--dataloader-inter-document-masking --object-storage-cache-path= "
        "--mid-level-dataset-surplus= --allow-ambiguous-pad-tokens --fim-split-sample= "
        "--fim-fragment-rate= --fim-no-prefix= --fim-prefix-token= --fim-middle-token= "
        "--fim-suffix-token= --fim-pad-token= --fim-eod-token= "
    ),
    "tokenizer": (
        "--padded-vocab-size= --no-pad-vocab-size --disable-pad-vocab-size --vocab-extra-ids= "
        "--tokenizer-metadata= --tokenizer-special-tokens=* --tiktoken-num-special-tokens= "
        "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
        "--tokenizer-hf-no-include-special-tokens --trust-remote-code --null-tokenizer-eod-id= "
        "--null-tokenizer-pad-id= --chat-template= --use-gigatoken "
    ),
    "autoresume": ("--adlr-autoresume --adlr-autoresume-interval= "),
    "mla": (
        "--rotary-scaling-factor= --mscale= --mscale-all-dim= --cache-mla-latents "
        "--mla-down-proj-fusion "
    ),
    "heterogeneous architecture": (
        "--heterogeneous-layers-config-path= --heterogeneous-layers-config-encoded-json= "
    ),
    "logging": (
        "--log-progress --timing-log-option= --tensorboard-log-interval= "
        "--no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard "
        "--log-memory-interval= --log-device-memory-used --log-max-attention-logit "
        "--no-barrier-with-level-1-timing --log-world-size-to-tensorboard --logging-level= "
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
    "experimental": (
        "--enable-experimental --spec=* --yaml-cfg= --use-precision-aware-optimizer "
        "--main-grads-dtype= --main-params-dtype= --exp-avg-dtype= --exp-avg-sq-dtype= "
    ),
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
    "rerun engine": ("--check-for-spiky-loss "),
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
