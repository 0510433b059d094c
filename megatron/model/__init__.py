"""The GPT model: this rank's pipeline stage built on megatron-core (`build.py`: build and
shard it), its layer specs and host fallbacks (`gpt.py`), and one file per model feature (MLA,
DSA, MTP, Gated DeltaNet, muP, recomputation, MoE), each with its flags (`add_<feature>_args`,
`validate_<feature>_args`), its `TransformerConfig` fields (`<feature>_config_fields`) and, where
the loop needs one, its per-step hook. Imports only megatron.common, megatron.pipeline and
megatron.distributed: nothing of the training loop."""

from megatron.common import core_import  # noqa: F401  (megatron-core imported lean: see there)
