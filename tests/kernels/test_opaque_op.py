"""``OpaqueOp``: the plain function when called eagerly, one opaque op in a torch.compile graph
(a body with a host sync that Dynamo could not trace, as the CPU attention's is)."""

from __future__ import annotations

import sys

import torch

from localllm.kernels.opaque_op import opaque_op

calls: list[str] = []


@opaque_op("localllm_test::scaled_by_positives")
def scaled_by_positives(x: torch.Tensor, factor: float) -> torch.Tensor:
    calls.append("called" if sys._getframe(1).f_code.co_name == "__call__" else "dispatched")  # by OpaqueOp, or the op
    n = int((x > 0).sum())  # a host sync: a graph break (a failure with fullgraph) without the op
    return x * (factor * n)


@scaled_by_positives.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def test_eager_calls_run_the_function_and_graphs_hold_the_op() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    calls.clear()
    assert torch.equal(scaled_by_positives(x, 0.5), x * 1.0)
    assert calls == ["called"]  # the function itself: no dispatcher, no Dynamo
    assert scaled_by_positives.__name__ == "scaled_by_positives"

    def f(x: torch.Tensor) -> torch.Tensor:
        return scaled_by_positives(x + 1, 2.0) - 1

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # noqa: ANN202
        graphs.append(gm)
        return gm

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    calls.clear()
    assert torch.equal(compiled(x), f(x))
    assert calls[0] == "dispatched"  # the graph ran the op (then f(x) called the function)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("localllm_test.scaled_by_positives" in t for t in targets), targets
