"""The tree the vocabulary split's messages travel on (`vocab_parallel.py`): torch-free, so the
simulator's link model costs the same tree the runtime uses."""

from dataclasses import dataclass


@dataclass(frozen=True)
class VocabTree:
    """The tree the vocabulary messages travel on: `num_ranks` pipeline stages, rooted at the
    last stage's (`root`), each node with up to `arity` children. Positions count from the
    root down the pipeline (position i is stage root - i, modulo N), so a node's children are
    the stages just before it: on a pipeline laid out node by node they are mostly on its
    node. Arity 2: floor(log2 N) hops to the deepest rank, two messages out of each rank."""

    num_ranks: int
    root: int
    arity: int = 2

    def __post_init__(self):
        if self.arity < 1 or not 0 <= self.root < self.num_ranks:
            raise ValueError(f"no tree of arity {self.arity} rooted at {self.root} "
                             f"over {self.num_ranks} ranks")  # fmt: skip

    def _stage(self, position: int) -> int:
        return (self.root - position) % self.num_ranks

    def _position(self, stage: int) -> int:
        return (self.root - stage) % self.num_ranks

    def parent(self, stage: int) -> int | None:
        position = self._position(stage)
        return None if position == 0 else self._stage((position - 1) // self.arity)

    def children(self, stage: int) -> list[int]:
        first = self.arity * self._position(stage) + 1
        last = min(first + self.arity, self.num_ranks)
        return [self._stage(position) for position in range(first, last)]

    def depth(self, stage: int) -> int:
        """Hops from the root to `stage`."""
        hops, parent = 0, self.parent(stage)
        while parent is not None:
            hops, parent = hops + 1, self.parent(parent)
        return hops

    def path(self, stage: int) -> list[int]:
        """The stages from the root down to `stage`, both included."""
        stages = [stage]
        while (parent := self.parent(stages[-1])) is not None:
            stages.append(parent)
        return stages[::-1]
