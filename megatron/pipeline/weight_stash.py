"""Weight stashing for PipeDream and PipeDream-2BW: older weight versions of one stage.

The live version is the parameters' own tensors: the optimizer steps them in place and this
module never replaces them (an optimizer that keeps master weights or flat buffers behind the
parameters keeps them). An older version is one tensor per trainable parameter, a copy of the
live values taken just before the step that would overwrite them, and only if some microbatch
still needs them: one in flight that was forwarded on them, or (PipeDream-2BW) a forward still
to come that is pinned to them. It is dropped as soon as nothing needs it.

A pass on an older version runs with `param.data` pointing at that version's tensors (swapped
in for the forward or backward, swapped back after). Autograd keeps what a forward saves for
its backward by reference, and a forward may well have run on the live tensors that a later
step then changes in place (2BW forwards batch b on the live W(b-1) before the step that makes
W(b)). So while a stashing forward runs, every saved tensor that aliases a parameter (the
weight itself, `weight.t()`, a slice of a fused weight) is saved as a `SavedParameterView`,
which the backward rebuilds on the version the forward used: the live tensors if no step came
in between, else the copy the step left behind. The backward therefore sees exactly the values
its forward saw, whatever the optimizer did meanwhile.

A version may also hold buffers that decide what a forward computes (the MoE router's expert
bias, which picks each token's experts and is updated at each step): they are copied, swapped
and redirected with the weights, so a forward on an older version routes with that version's
bias and its backward (an activation recomputation included) routes the same way.
"""

import bisect
import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SavedParameterView:
    """A tensor autograd saved that aliases parameter `index` of weight `version`."""

    index: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the start of the parameter's tensor


class WeightStash:
    """The older weight versions of one stage, and the saved-tensor redirection onto them."""

    def __init__(self, parameters, buffers=()):
        # the trainable parameters, then the buffers versioned with them (no gradient)
        self.params = [p for p in parameters if p.requires_grad] + list(buffers)
        self.versions: dict[int, list[torch.Tensor]] = {}  # version -> copies (not live)
        self.live_version = 0  # the stage's optimizer steps so far
        self.peak_versions = 0  # most older versions held at once
        self.peak_bytes = 0  # their bytes at that point

    # ------------------------------------------------------------------ versions
    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for v in self.versions.values() for t in v)

    def keep_live_version(self) -> None:
        """Copy the live values before a step overwrites them (a microbatch needs them)."""
        if self.live_version not in self.versions:
            self.versions[self.live_version] = [p.detach().clone() for p in self.params]
            if len(self.versions) >= self.peak_versions:
                self.peak_versions, self.peak_bytes = len(self.versions), self.held_bytes

    def stepped(self) -> None:
        self.live_version += 1

    def release_unneeded(self, needed) -> None:
        """Drop every older version for which `needed(version)` is false."""
        for version in [v for v in self.versions if not needed(v)]:
            del self.versions[version]

    def tensors_of(self, version: int) -> list[torch.Tensor]:
        if version == self.live_version:
            return [p.data for p in self.params]
        if version not in self.versions:
            raise RuntimeError(
                f"weight version {version} is needed but was not kept (live version "
                f"{self.live_version}, kept {sorted(self.versions)})"
            )
        return self.versions[version]

    @contextlib.contextmanager
    def swapped_in(self, version: int):
        """The parameters hold weight `version` inside the block (nothing to do when live)."""
        if version == self.live_version:
            yield
            return
        stashed = self.tensors_of(version)
        live = [p.data for p in self.params]
        try:
            for param, tensor in zip(self.params, stashed):
                param.data = tensor
            yield
        finally:
            for param, tensor in zip(self.params, live):
                param.data = tensor

    # ------------------------------------------------------------------ saved tensors
    def redirection(self, version: int) -> "SavedTensorRedirection":
        """Pack/unpack functions for a forward on weight `version` (see the module doc)."""
        return SavedTensorRedirection(self, version)

    def rebuild(self, view: SavedParameterView) -> torch.Tensor:
        base = self.tensors_of(view.version)[view.index]
        return base.as_strided(view.size, view.stride, base.storage_offset() + view.offset)


class SavedTensorRedirection:
    """Recognizes saved tensors that alias a parameter of one weight version by address."""

    def __init__(self, stash: WeightStash, version: int):
        self.stash, self.version = stash, version
        tensors = stash.tensors_of(version)
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
            for i, t in enumerate(tensors)
            if t.numel()
        )
        self._starts = [start for start, _, _ in spans]
        self._spans = spans
        self._tensors = tensors

    def pack(self, tensor: torch.Tensor) -> SavedParameterView | None:
        """The view to rebuild `tensor` from, or None when it aliases no parameter."""
        if not self._spans or tensor.numel() == 0 or tensor.layout is not torch.strided:
            return None
        address = tensor.data_ptr()
        position = bisect.bisect_right(self._starts, address) - 1
        if position < 0:
            return None
        start, end, index = self._spans[position]
        base = self._tensors[index]
        if address >= end or tensor.dtype != base.dtype or tensor.device != base.device:
            return None
        return SavedParameterView(
            index=index,
            version=self.version,
            size=tuple(tensor.size()),
            stride=tuple(tensor.stride()),
            offset=(address - start) // base.element_size(),
        )

    def unpack(self, saved):
        return self.stash.rebuild(saved) if isinstance(saved, SavedParameterView) else saved
