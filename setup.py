"""Asynchronous pipeline-parallel schedules (PACI, PipeDream-2BW, ...) on megatron-core.

`megatron/` is a namespace package shared with megatron-core: we ship `megatron.training` and
`megatron.pipeline` beside the installed `megatron.core`.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-paci",
    version="0.1.0",
    description="Asynchronous pipeline-parallel schedules (PACI) for megatron-core GPT pretraining",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_namespace_packages(
        include=[
            "megatron.common*",
            "megatron.pipeline*",
            "megatron.distributed*",
            "megatron.model*",
            "megatron.training*",
            "megatron.benchmarks*",
            "megatron.studies*",
        ]
    ),
    py_modules=["pretrain_gpt"],
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "numpy",
        "sentencepiece>=0.2",
        "tensorboard>=2.16",
        "pytorch_optimizer>=3.0",
        "einops",  # megatron-core's partial data-parallel groups (distributed optimizer copies)
    ],
    extras_require={
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3",  # make test: the unit tests on both cores
            "pyyaml",
            "black",
            "isort",
            "matplotlib",
            "tokenizers",
            "tiktoken",
            "wandb>=0.31",
        ],
        "hf": ["tokenizers"],  # --tokenizer-type HuggingFaceTokenizer
        "tiktoken": ["tiktoken"],  # --tokenizer-type TikTokenizer
        "wandb": ["wandb>=0.31"],  # --wandb-project (Weights & Biases logging)
        "gpu": ["transformer-engine[pytorch]", "apex"],
    },
)
