"""What a saved decode graph is keyed by, on the kernels' side: every C++ op's schema and the
shape functions torch.compile traced with, and nothing of the kernels' bodies (a body change
runs in the old graph through the dispatcher; a schema change must give a new key)."""

import re

import pytest

from localllm.engine.model_runner import _kernel_interface
from localllm.kernels import cpu_ops


@pytest.mark.skipif(not cpu_ops.load(), reason="needs the CPU kernels")
def test_the_graph_key_holds_every_ops_schema_and_no_kernel_body() -> None:
    text = _kernel_interface()
    ops_cpp = (cpu_ops.SOURCE_DIR / "ops.cpp").read_text()
    declared = re.findall(r'm\.def\("(\w+)\(', ops_cpp)
    assert len(declared) >= 8
    for name in declared:
        assert f"localllm_cpu::{name}(" in text, name  # an op the key misses could change under a saved graph
    assert "register_fake" in text  # the shapes a graph was traced with
    # no kernel body: a translation unit's text is not part of it
    for tu in cpu_ops.translation_units():
        body = tu.read_text()
        assert body[-400:] not in text
