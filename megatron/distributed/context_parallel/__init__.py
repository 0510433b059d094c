"""Context parallelism: each rank holds 2 chunks of every sequence (chunk i and 2CP-1-i, as
megatron-core's `get_batch_on_this_cp_rank`); attention over the whole sequence by a ring of
key/value passes (`ring.py`), one all-gather of keys and values (`all_gather.py`) or head-wise
all-to-alls (`all_to_all.py`), chosen per layer by `--cp-comm-type` (`attention.py`; the
flags and their checks in `flags.py`)."""
