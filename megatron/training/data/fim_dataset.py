"""``GPTFIMDataset``: megatron-core's GPTDataset with fill-in-the-middle samples (``--fim-data``).

The subclass changes only what a sample's tokens are: megatron-core draws them as usual (the
same document, sample and shuffle indices, cached under this class's name), then ``fim.py``'s
transform rearranges them, drawing from the sample's own generator. Labels, loss mask and
position ids are computed by GPTDataset from the rearranged tokens, as in Megatron-LM, so the
loss covers the sentinels and any ``--fim-pad-token`` padding too.
"""

import os
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron.training.data.fim import FimSettings, FimTransform, sample_generator


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig and the ``--fim-*`` settings."""

    fim: Optional[FimSettings] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fim is None:
            raise ValueError("GPTFIMDatasetConfig needs fim=FimSettings(...)")


class GPTFIMDataset(GPTDataset):
    """GPTDataset whose samples go through the FIM transform (module docstring)."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                 config: GPTFIMDatasetConfig) -> None:  # fmt: skip
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        self.fim_transform = FimTransform(config.fim, config.tokenizer)
        # The datasets of a blend draw apart; the name, not the whole path, so that a copy of
        # the data elsewhere gives the same samples.
        dataset_name = os.path.basename(str(dataset_path)).encode()
        self.fim_key = (config.random_seed, index_split.value, zlib.crc32(dataset_name))

    def _query_document_sample_shuffle_indices(
        self, idx: int
    ) -> Tuple[numpy.ndarray, numpy.ndarray]:
        tokens, document_ids = super()._query_document_sample_shuffle_indices(idx)
        # megatron-core pads a short last sample with its pad id, which may be -1 (no padding
        # token): keep that tail as it is (GPTDataset masks its loss) and rearrange the rest.
        length = len(tokens)
        if self._pad_token_id < 0:
            while length and tokens[length - 1] == self._pad_token_id:
                length -= 1
        rng = sample_generator(*self.fim_key, idx)
        rearranged = self.fim_transform(tokens[:length], rng)
        return numpy.concatenate([rearranged, tokens[length:]]), document_ids
