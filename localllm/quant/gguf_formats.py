"""GGUF tensor types: the one table of what each ggml block format is and what localllm does
with it. The loader, the planner's sizing, ``localllm probe``, the CPU kernels' Python side and
docs/quantization.md read it here instead of restating block sizes.

Per type: the GGML type id (the number a GGUF tensor header stores), the weights per block and
the bytes per block, the block's fields in byte order (``BlockField``: their sizes add up to
the block's bytes), how the weights of one scale group are reconstructed, the sub-block that
shares one scale, llama.cpp's fallback for rows that are not a whole number of blocks, and
``packed``: the layout localllm's CPU kernel repacks the type into at load, or None where no
kernel takes it (the loader then requantizes the module to ``FALLBACK``, a second rounding,
and says so in the plan's reason line); ``gpu``: whether the GPU's Triton kernels
(kernels/gguf_linear.py) multiply the type as stored (the same fallback where not).

Invariants: every ``block_bytes`` equals the ``gguf`` package's ``GGML_QUANT_SIZES`` and
llama.cpp's ``sizeof(block_*)`` (tests/quant/test_gguf_formats.py); a ``packed`` type's
kernel reproduces the ``gguf`` package's dequantization exactly. This module imports nothing
heavy (no torch, numpy or gguf): the CLI's sizing reads it before any engine exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockField:
    """One field of a block, in the file's byte order."""

    name: str  # llama.cpp's name in block_<type> (ggml-common.h)
    nbytes: int
    what: str


@dataclass(frozen=True, slots=True)
class GGUFFormat:
    """One ggml tensor type as a GGUF file stores it."""

    type_id: int  # GGMLQuantizationType value
    name: str  # llama.cpp's name: "Q4_K"
    block_weights: int  # weights per block, consecutive along a row (1 for plain floats)
    block_bytes: int
    fields: tuple[BlockField, ...]
    sub_block: int  # weights sharing one scale (and min); block_weights for one-scale blocks
    formula: str  # how one weight comes back from the block, in ggml's terms
    packed: str | None = None  # the CPU kernel's packed layout (None: no kernel takes the type)
    row_fallback: str | None = None  # llama.cpp's type for rows not a multiple of block_weights
    gpu: bool = False  # the Triton kernels (kernels/gguf_linear.py) take it as stored on CUDA

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / self.block_weights

    @property
    def is_float(self) -> bool:
        return self.block_weights == 1

    @property
    def cpu_kernel(self) -> bool:
        """Whether localllm's CPU kernels multiply this type as stored."""
        return self.packed is not None

    def has_kernel(self, kernels: str) -> bool:
        """Whether ``kernels`` (``KERNELS``: "cpu", localllm's C++ kernels, or "triton", the
        GPU's) multiply this type as stored."""
        if kernels not in KERNELS:
            raise ValueError(f"unknown GGUF kernels {kernels!r}; use one of {', '.join(KERNELS)}")
        return self.cpu_kernel if kernels == "cpu" else self.gpu

    def row_bytes(self, row_weights: int) -> int:
        """Stored bytes of one row; raises ValueError when the row is not whole blocks."""
        if row_weights % self.block_weights:
            raise ValueError(f"a {self.name} row holds whole blocks of {self.block_weights} weights, not {row_weights}")
        return row_weights // self.block_weights * self.block_bytes

    def nbytes(self, weights: int) -> int:
        """Stored bytes of ``weights`` values (rounded up to whole blocks, for sizing)."""
        return -(-weights // self.block_weights) * self.block_bytes


def _f(name: str, nbytes: int, what: str) -> BlockField:
    return BlockField(name, nbytes, what)


_D = _f("d", 2, "fp16 scale")
_DM = (_f("d", 2, "fp16 scale"), _f("m", 2, "fp16 minimum"))
_K_SCALES = (_f("d", 2, "fp16 super-block scale of the scales"), _f("dmin", 2, "fp16 super-block scale of the mins"),
             _f("scales", 12, "8 x (6-bit scale, 6-bit min), packed"))
# The CPU kernels' packed layouts (kernels/cpu/gguf/formats.h; their sizes: quant/gguf.py's
# PACKED): 8-row tiles of nibbles (plus 1 or 2 high-bit planes) or int8 codes, with the
# block's own scales beside them.
_Q4_TILE = "q4 tile"
_Q8_TILE = "q8 tile"

FORMATS: tuple[GGUFFormat, ...] = (
    GGUFFormat(0, "F32", 1, 4, (_f("value", 4, "float32"),), 1, "w = value"),
    GGUFFormat(1, "F16", 1, 2, (_f("value", 2, "float16"),), 1, "w = value"),
    GGUFFormat(30, "BF16", 1, 2, (_f("value", 2, "bfloat16"),), 1, "w = value"),
    GGUFFormat(2, "Q4_0", 32, 18, (_D, _f("qs", 16, "32 x 4-bit codes")), 32, "w = d * (q - 8)", _Q4_TILE, gpu=True),
    GGUFFormat(3, "Q4_1", 32, 20, (*_DM, _f("qs", 16, "32 x 4-bit codes")), 32, "w = d * q + m", "q4 m tile", gpu=True),
    GGUFFormat(6, "Q5_0", 32, 22, (_D, _f("qh", 4, "32 x 5th bit"), _f("qs", 16, "32 x low 4 bits")), 32,
               "w = d * (q - 16)", "q5 tile", gpu=True),
    GGUFFormat(7, "Q5_1", 32, 24, (*_DM, _f("qh", 4, "32 x 5th bit"), _f("qs", 16, "32 x low 4 bits")), 32,
               "w = d * q + m", "q5 m tile", gpu=True),
    GGUFFormat(8, "Q8_0", 32, 34, (_D, _f("qs", 32, "32 x int8 codes")), 32, "w = d * q", _Q8_TILE, gpu=True),
    GGUFFormat(10, "Q2_K", 256, 84, (_f("scales", 16, "16 x (4-bit scale, 4-bit min)"), _f("qs", 64, "256 x 2-bit"),
                                     _f("d", 2, "fp16 super-block scale"), _f("dmin", 2, "fp16 super-block min scale")),
               16, "w = d * sc * q - dmin * mn", row_fallback="Q4_0"),
    GGUFFormat(11, "Q3_K", 256, 110, (_f("hmask", 32, "256 x high bit"), _f("qs", 64, "256 x low 2 bits"),
                                      _f("scales", 12, "16 x 6-bit scale, packed"),
                                      _f("d", 2, "fp16 super-block scale")),
               16, "w = d * (sc - 32) * (q - 4)", row_fallback="Q4_0"),
    GGUFFormat(12, "Q4_K", 256, 144, (*_K_SCALES, _f("qs", 128, "256 x 4-bit codes")), 32,
               "w = d * sc * q - dmin * mn", "q4_k tile", row_fallback="Q5_0", gpu=True),
    GGUFFormat(13, "Q5_K", 256, 176, (*_K_SCALES, _f("qh", 32, "256 x 5th bit"), _f("qs", 128, "256 x low 4 bits")), 32,
               "w = d * sc * q - dmin * mn", "q5_k tile", row_fallback="Q5_1",
               gpu=True),
    GGUFFormat(14, "Q6_K", 256, 210, (_f("ql", 128, "256 x low 4 bits"), _f("qh", 64, "256 x high 2 bits"),
                                      _f("scales", 16, "16 x int8 scale"), _f("d", 2, "fp16 super-block scale")),
               16, "w = d * sc * (q - 32)", "q6_k tile", row_fallback="Q8_0", gpu=True),
    GGUFFormat(20, "IQ4_NL", 32, 18, (_D, _f("qs", 16, "32 x 4-bit index into a 16-value table")), 32,
               "w = d * kvalues_iq4nl[q]", _Q4_TILE, gpu=True),
    GGUFFormat(23, "IQ4_XS", 256, 136, (_f("d", 2, "fp16 super-block scale"),
                                        _f("scales_h", 2, "8 x high 2 bits of scale"),
                                        _f("scales_l", 4, "8 x low 4 bits of scale"),
                                        _f("qs", 128, "256 x 4-bit index into a 16-value table")),
               32, "w = d * (sc - 32) * kvalues_iq4nl[q]", "iq4_xs tile", row_fallback="IQ4_NL",
               gpu=True),
    GGUFFormat(39, "MXFP4", 32, 17, (_f("e", 1, "E8M0 shared exponent"), _f("qs", 16, "32 x FP4 E2M1 codes")), 32,
               "w = 2^(e - 127) * kvalues_mxfp4[q] / 2", "mxfp4 tile", gpu=True),
)

KERNELS = ("cpu", "triton")  # who multiplies a plan's blocks: the CPU's C++ kernels or the GPU's Triton ones
BY_ID: dict[int, GGUFFormat] = {f.type_id: f for f in FORMATS}
BY_NAME: dict[str, GGUFFormat] = {f.name: f for f in FORMATS}
# What a linear whose type no kernel takes becomes: rounded again from the dequantized weights
# into the finest kernel type, so the second rounding costs least (8 bits on 2-6 bit codes).
FALLBACK = "Q8_0"


def fmt(type_id_or_name: int | str) -> GGUFFormat:
    """The format of a type id (an int, or an IntEnum such as gguf's) or name; raises
    ValueError naming the unknown type."""
    if isinstance(type_id_or_name, str):
        found = BY_NAME.get(type_id_or_name.upper())
    else:
        found = BY_ID.get(int(type_id_or_name))
    if found is None:
        raise ValueError(f"GGUF tensor type {type_id_or_name!r} is not one localllm knows "
                         f"({', '.join(f.name for f in FORMATS)})")
    return found


def type_name(type_id: int) -> str:
    """A type's name, or ``type <id>`` for one the table lacks (for messages)."""
    f = BY_ID.get(int(type_id))
    return f.name if f is not None else f"type {int(type_id)}"


def cpu_kernel_types() -> frozenset[int]:
    """Type ids localllm's CPU kernels multiply as stored."""
    return frozenset(f.type_id for f in FORMATS if f.cpu_kernel)


def triton_kernel_types() -> frozenset[int]:
    """Type ids the GPU's Triton kernels multiply as stored."""
    return frozenset(f.type_id for f in FORMATS if f.gpu)


def markdown_table() -> str:
    """The table docs/quantization.md shows (a test holds the doc to it)."""
    rows = ["| type | id | weights per block | bytes per block | bits per weight | block fields (bytes) "
            "| one weight | CPU kernel | GPU kernel | rows not whole blocks |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for f in FORMATS:
        if f.is_float:
            continue
        fields = ", ".join(f"{b.name} {b.nbytes}" for b in f.fields)
        kernel = f"as stored ({f.packed})" if f.cpu_kernel else f"requantized to {FALLBACK}"
        gpu = "as stored (Triton)" if f.gpu else f"requantized to {FALLBACK}"
        rows.append(f"| {f.name} | {f.type_id} | {f.block_weights} | {f.block_bytes} | {f.bits_per_weight:.4g} "
                    f"| {fields} | `{f.formula}` | {kernel} | {gpu} | {f.row_fallback or ''} |")
    return "\n".join(rows)
