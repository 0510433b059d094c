"""Virtual stages: where the model chunks of a pipeline live.

The model is cut into S = N * v consecutive virtual stages (model chunks) run by N ranks, v
chunks per rank. Activations flow from virtual stage k to k + 1 and gradients back from k + 1
to k, whichever ranks hold them. A rank numbers its own chunks 0 .. v - 1 (the model-chunk id,
the index into the rank's list of modules); actions name that local id, and a `Placement`
turns it into the virtual stage and back.

Two placements:

* ``interleaved`` (Narayanan et al., SC21; Megatron's virtual pipeline): rank r holds virtual
  stages r, r + N, r + 2N, ...: chunk c is virtual stage c * N + r, so every hop between
  virtual stages crosses to the next rank (the last rank wraps around to rank 0);
* ``v`` (the V shape of ZB-V and DualPipeV): with v = 2, rank r holds virtual stages r and
  2N - 1 - r. Activations go down the ranks through chunk 0 and back up through chunk 1, so
  rank 0 holds both the first and the last virtual stage, and the hop N - 1 -> N stays on
  rank N - 1 (no transfer). For larger even v the V repeats (a zigzag).

With v = 1 both are the plain pipeline: rank r is stage r.
"""

from dataclasses import dataclass

PLACEMENTS = ("interleaved", "v")


@dataclass(frozen=True)
class Placement:
    shape: str  # one of PLACEMENTS
    num_ranks: int
    chunks_per_rank: int

    def __post_init__(self):
        if self.shape not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.shape!r} (known: {', '.join(PLACEMENTS)})")
        for name in ("num_ranks", "chunks_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.shape == "v" and self.chunks_per_rank % 2:
            raise ValueError(
                f"the V placement needs an even number of chunks per rank, "
                f"got {self.chunks_per_rank}"
            )

    @property
    def num_virtual_stages(self) -> int:
        return self.num_ranks * self.chunks_per_rank

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """The virtual stage that `rank` runs as its model chunk `chunk`."""
        if not (0 <= rank < self.num_ranks and 0 <= chunk < self.chunks_per_rank):
            raise ValueError(f"no chunk {chunk} on rank {rank} of {self}")
        n = self.num_ranks
        if self.shape == "v" and chunk % 2:  # the way back up the V
            return (chunk + 1) * n - 1 - rank
        return chunk * n + rank

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) that runs `virtual_stage`."""
        if not 0 <= virtual_stage < self.num_virtual_stages:
            raise ValueError(f"no virtual stage {virtual_stage} in {self}")
        chunk, offset = divmod(virtual_stage, self.num_ranks)
        if self.shape == "v" and chunk % 2:
            return self.num_ranks - 1 - offset, chunk
        return offset, chunk

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages of `rank`, by chunk id."""
        return [self.virtual_stage(rank, c) for c in range(self.chunks_per_rank)]


def interleaved(num_ranks: int, chunks_per_rank: int) -> Placement:
    return Placement("interleaved", num_ranks, chunks_per_rank)


def v_shape(num_ranks: int, chunks_per_rank: int = 2) -> Placement:
    return Placement("v", num_ranks, chunks_per_rank)
