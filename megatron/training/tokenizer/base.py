"""What every tokenizer of ``--tokenizer-type`` offers (tokenizer.py lists them); megatron-core's
datasets read its properties."""

import json
from collections import OrderedDict
from typing import List, Optional, Sequence


class Tokenizer:
    """What every tokenizer here offers; megatron-core's datasets use the properties."""

    def __init__(self, *paths: str, **options) -> None:
        identifiers = OrderedDict()
        identifiers["class"] = type(self).__name__
        identifiers["tokenizer_path"] = list(paths)
        for key, value in options.items():
            identifiers[key] = str(value)
        self._unique_identifiers = identifiers

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """JSON-serializable description; megatron-core hashes it into dataset cache names."""
        return self._unique_identifiers

    @property
    def unique_description(self) -> str:
        return json.dumps(self._unique_identifiers, indent=4)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        """The end-of-document id, appended to documents by ``preprocess_data --append-eod``."""
        raise NotImplementedError

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        """The padding id; -1 means none (megatron-core then pads with -1 and masks it)."""
        return -1

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of the vocabulary entry spelled `token` (a special token such as
        ``<fim_prefix>``), None if the vocabulary has no such entry."""
        return None

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError
