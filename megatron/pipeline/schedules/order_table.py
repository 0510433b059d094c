"""Per-rank order tables: schedules written as a list of phases, read back from counters.

Some schedules (ZB-V, DualPipeV) are defined by the paper as a fixed per-rank sequence of
passes built in phases ("2(N - r) - 1 forwards of chunk 0, then r times F1 F0, ..."). Such a
schedule writes the sequence once per (rank, N, m) with `OrderWriter`, and `next_in_table`
turns it back into a decision: every pass raises exactly one of the rank's counters (F, B, W
over all chunks), so their sum, less the previous steps' passes, is the position in the table.
The decision still depends on counters only, as for every schedule.

Tokens of `OrderWriter.write`, microbatches numbered per (kind, chunk) in order:

* ``F0``, ``F1``: the next forward of chunk 0 / 1;
* ``B0``: the next input-gradient pass of chunk 0, its weight gradient left for later;
* ``BW0``: a full backward: the input and the weight gradient of the same microbatch in one
  slot, the gradient sent when both are done;
* ``W0``: the oldest weight gradient left for later on chunk 0; ``W``: the oldest on any chunk;
* ``F0&BW1``: passes joined by ``&`` run together in one slot (DualPipe's overlapped pair).
"""

import dataclasses

from .base import BACKWARD, DONE, FORWARD, STEP, WEIGHT_GRAD, Action, ActionKind, StageView


@dataclasses.dataclass(frozen=True)
class Slot:
    """One slot of a step: a pass (kind, chunk, microbatch within the step) and the passes run
    together with it."""

    kind: ActionKind
    chunk: int
    microbatch: int
    together: tuple["Slot", ...] = ()

    def action(self, first_microbatch: int) -> Action:
        together = tuple(s.action(first_microbatch) for s in self.together)
        return Action(self.kind, first_microbatch + self.microbatch, self.chunk, together)

    def __str__(self) -> str:
        return str(self.action(0))


class OrderWriter:
    """Builds a rank's table; passes of microbatches >= `keep` are counted but left out (a
    schedule defined for at least M microbatches, run with fewer)."""

    def __init__(self, chunks: int, keep: int):
        self.keep = keep
        self.next = {(kind, c): 0 for kind in (FORWARD, BACKWARD) for c in range(chunks)}
        self.deferred: list[tuple[int, int]] = []  # (chunk, microbatch) whose W is still due
        self.slots: list[Slot] = []

    def forwards(self, chunk: int) -> int:
        return self.next[(FORWARD, chunk)]

    def write(self, tokens: str, times: int = 1) -> None:
        for _ in range(times):
            for token in tokens.split():
                passes = [p for part in token.split("&") for p in self._passes(part)]
                if passes:
                    self.slots.append(dataclasses.replace(passes[0], together=tuple(passes[1:])))

    def _passes(self, part: str) -> list[Slot]:
        """The passes of one token part, those of microbatches >= `keep` left out."""
        if part.startswith("W"):
            chunk = None if part == "W" else int(part[1:])
            pending = [d for d in self.deferred if chunk is None or d[0] == chunk]
            if not pending:  # nothing is left for later: the token is a no-op
                return []
            self.deferred.remove(pending[0])
            return self._kept(WEIGHT_GRAD, *pending[0])
        kind = {"F": FORWARD, "B": BACKWARD, "BW": BACKWARD}[part[:-1]]
        chunk = int(part[-1])
        microbatch = self.next[(kind, chunk)]
        self.next[(kind, chunk)] += 1
        if part.startswith("BW"):
            if any(c == chunk for c, _ in self.deferred):
                raise ValueError(f"{part}: an older weight gradient of chunk {chunk} is due")
            return self._kept(BACKWARD, chunk, microbatch) + self._kept(
                WEIGHT_GRAD, chunk, microbatch
            )
        if kind is BACKWARD:
            self.deferred.append((chunk, microbatch))
        return self._kept(kind, chunk, microbatch)

    def _kept(self, kind: ActionKind, chunk: int, microbatch: int) -> list[Slot]:
        return [Slot(kind, chunk, microbatch)] if microbatch < self.keep else []

    def table(self) -> "Table":
        if self.deferred:
            raise ValueError(f"weight gradients never run: {self.deferred}")
        return Table(tuple(self.slots))


class Table:
    """A rank's slots for one step, and where each begins in passes done (a slot counts one
    pass plus those run together with it)."""

    def __init__(self, slots: tuple[Slot, ...]):
        self.slots = slots
        self.slot_at: dict[int, int] = {}  # passes done -> index of the next slot
        done = 0
        for index, slot in enumerate(slots):
            self.slot_at[done] = index
            done += 1 + len(slot.together)
        self.slot_at[done] = len(slots)
        self.passes = done

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)


def next_in_table(view: StageView, table: Table) -> Action:
    """The rank's next action: the slot at the position its counters give, the step once the
    table is done (a flush schedule: every step runs the whole table)."""
    m = view.microbatches_per_step
    call = view.backward_target // (m * view.num_chunks)  # 1-based: calls begun so far
    done = view.forwards + view.backwards + view.weight_grads - (call - 1) * table.passes
    index = table.slot_at[done]
    if index == len(table):
        due = view.step_enabled and view.steps < call
        return Action(STEP) if due else Action(DONE)
    return table.slots[index].action((call - 1) * m)
