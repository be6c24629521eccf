"""GGUF blocks held on the GPU as a module's buffers: the repacked ``GGUFPacked`` of
kernels/gguf_linear.py, shared by the block linear (quant/gguf_cuda.py) and the stacked
experts (quant/gguf_experts_cuda.py).

Invariant: before loading the module holds one empty uint8 buffer, ``blocks`` (``to_empty``
puts it on the model's device, where the file's blocks are copied); once ``install_packed``
ran, ``packed`` is the ``GGUFPacked`` whose tensors are the module's buffers (``codes``,
``high``, ``scales``, ``d``, ``lut``) and ``blocks`` is gone; moving the module rebuilds
``packed`` from the moved buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from localllm.kernels.gguf_linear import GGUFPacked, pack_gguf_blocks


class PackedBlocks(nn.Module):
    """The buffers of one ``GGUFPacked`` of format ``fmt``. A subclass calls ``init_blocks``
    in its constructor (after ``nn.Module``'s) and sets ``fmt`` and ``in_features``."""

    fmt: str
    in_features: int
    packed: GGUFPacked | None

    def init_blocks(self) -> None:
        self.register_buffer("blocks", torch.empty(0, dtype=torch.uint8))
        self.packed = None

    def install_packed(self, raw: torch.Tensor) -> None:
        """The file's blocks ``raw`` (uint8 [rows, row_bytes] on the device), repacked by kind
        into this module's buffers; the caller drops ``raw`` (one copy of the bytes is kept)."""
        packed = pack_gguf_blocks(raw, self.fmt)
        del self._buffers["blocks"]
        for name, t in packed.tensors().items():
            self.register_buffer(name, t)
        self.packed = packed

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:  # noqa: ANN401
        super()._apply(fn, recurse)
        if self.packed is not None:  # the buffers moved: the packed view follows them
            self.packed = GGUFPacked.from_tensors(self.fmt, self.packed.out_features, self.in_features,
                                                  {n: self._buffers[n] for n in self.packed.tensors()})
        return self
