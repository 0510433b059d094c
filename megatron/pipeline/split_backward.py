"""A stage's backward in two passes: the input gradient now, the weight gradient later.

Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) send the input gradient upstream as soon as it
is computed (B) and compute the weight gradient (W) when the stage would otherwise idle. With
torch autograd, on the graph the forward built:

* B runs the backward only towards the stage's input (`inputs=[input]`, graph kept). The engine
  then evaluates just the part of each node that leads to the input: a matrix product computes
  its input gradient and skips its weight gradient. A pre-hook on every *boundary* node (a node
  on the way to the input that also feeds a parameter) keeps the gradient that reached it.
* W restarts the backward at each boundary node from the kept gradient, towards the
  parameters under it only, and accumulates into `.grad` as a full backward would. The work of
  the input path is not repeated (except inside custom autograd Functions, whose backward
  computes all its outputs at once: megatron-core's tensor-parallel linear layers; their weight
  gradient then costs their whole backward again, the numbers are the same).

The parameters under two boundary nodes (a weight used twice, e.g. tied embeddings on one
chunk) would receive part of their gradient twice; such a graph, and a stage without input
(the first virtual stage: nothing to send upstream), takes its whole backward in W instead.
"""

import torch
from torch.autograd.graph import GradientEdge


def _reachable(root) -> list:
    """Every autograd node reachable from `root` (`next_functions`), each once."""
    seen, stack, order = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return order


def _nodes_leading_to(target, nodes: list) -> set:
    """The nodes among `nodes` from which `target` is reachable (`target` included)."""
    parents: dict = {}
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(child, []).append(node)
    leading, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node in leading:
            continue
        leading.add(node)
        stack.extend(parents.get(node, ()))
    return leading


def _parameters_under(node, input_path: set) -> tuple[list, set]:
    """The leaf tensors (parameters) reachable from `node` without entering the input path,
    and the nodes visited on the way."""
    params, seen = [], set()
    stack = [c for c, _ in node.next_functions if c is not None and c not in input_path]
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        variable = getattr(child, "variable", None)
        if variable is not None:
            params.append(variable)
        stack.extend(c for c, _ in child.next_functions if c is not None)
    return params, seen


class PendingWeightGradient:
    """What W needs of one microbatch: the boundary gradients kept by B (or, when the graph
    cannot be split, the whole backward)."""

    def __init__(self, output: torch.Tensor, grad: torch.Tensor | None, parts: list | None):
        self._output, self._grad = output, grad
        self._parts = parts  # [(boundary node, kept gradients, parameters)], None: whole

    def run(self) -> None:
        """Accumulate the weight gradient into `.grad` and drop the graph."""
        if self._parts is None:
            torch.autograd.backward(self._output, grad_tensors=self._grad)
        else:
            for node, kept, params in self._parts:
                edges = [GradientEdge(node, k) for k, g in enumerate(kept) if g is not None]
                grads = [g for g in kept if g is not None]
                if edges and params:
                    torch.autograd.backward(edges, grad_tensors=grads, inputs=params)
        self._output = self._grad = self._parts = None


def backward_input(
    output: torch.Tensor, grad: torch.Tensor | None, input_tensor: torch.Tensor | None
) -> PendingWeightGradient:
    """B: the gradient of `input_tensor` (left in its `.grad`); returns what W needs."""
    root = output.grad_fn
    if input_tensor is None or root is None:
        return PendingWeightGradient(output, grad, None)
    nodes = _reachable(root)
    input_node = next((n for n in nodes if getattr(n, "variable", None) is input_tensor), None)
    if input_node is None:  # the output does not depend on the input
        return PendingWeightGradient(output, grad, None)
    input_path = _nodes_leading_to(input_node, nodes)
    boundary = [
        node
        for node in input_path
        if any(c is not None and c not in input_path for c, _ in node.next_functions)
    ]
    under = [_parameters_under(node, input_path) for node in boundary]
    if not _disjoint([visited for _, visited in under]):
        torch.autograd.backward(output, grad_tensors=grad, inputs=[input_tensor], retain_graph=True)
        return PendingWeightGradient(output, grad, None)
    kept: dict = {}
    hooks = [
        node.register_prehook(lambda grads, node=node: kept.__setitem__(node, grads))
        for node in boundary
    ]
    try:
        torch.autograd.backward(output, grad_tensors=grad, inputs=[input_tensor], retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    parts = [
        (node, kept[node], params)
        for node, (params, _) in zip(boundary, under)
        if node in kept and params
    ]
    return PendingWeightGradient(output, grad, parts)


def _disjoint(sets: list[set]) -> bool:
    seen: set = set()
    for nodes in sets:
        if seen & nodes:
            return False
        seen |= nodes
    return True
