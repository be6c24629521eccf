"""GGUF blocks kept as stored on the GPU: y = x @ W.T with W's ggml blocks dequantized in
registers, by a Triton GEMV (decode) and GEMM (prefill), beside their torch reference.

Layout (``GGUFPacked``, made once at load by ``pack_gguf_blocks`` on the blocks' own device):
a block's fields are split by kind into four row-major tensors, so a row's codes for a K
tile are one contiguous run (a 256-wide K tile of Q4_K is 128 bytes per row) and the kernel
reads them with wide loads, while the small per-block fields sit apart:

- ``codes`` int32 [N, K * lo_bits / 32]: the low bits of every weight (the file's ``qs``/``ql``),
  in straight order: weight ``k`` of the row is bits ``lo_bits * (k % per) ..`` of word
  ``k // per`` (``per = 32 / lo_bits``). The file's own nibble order differs per type (Q4_K puts
  weights i and i + 32 in one byte); ``pack_gguf_blocks`` undoes it once.
- ``high`` int32 [N, K * hi_bits / 32]: the high bits (``qh``: 1 for Q5_*, 2 for Q6_K), straight
  order too; zero columns for types without them.
- ``scales`` uint8 [N, K / block_weights, nsc]: the block's packed scale bytes as the file has
  them (Q4_K's 12 bytes of 6-bit scales and mins, Q6_K's 16 int8 scales, IQ4_XS's scales_h +
  scales_l, MXFP4's E8M0 exponent); decoded in registers, so nothing is widened.
- ``d`` fp16 [N, K / block_weights, nd]: the block's fp16 fields (d; d and m or dmin).

Invariants: the four tensors hold exactly the file's bytes (bits per weight equal to the
file's); ``dequantize_packed`` equals the ``gguf`` package's ``quants.dequantize`` of the raw
blocks bit for bit, and so do the kernels' in-register decode (``_decode_tile``) and the
dequantize kernel's fp32 output (``dequantize_triton``): every product in these formulas is
exact in fp32, so a fused multiply-add rounds as numpy's two operations do. The tensor-core
paths then round those weights once to fp16/bf16 when x is half precision. The decode GEMV
(``_gemv_tile``) does not form the weights: it sums x times each code's value per sub-block
and applies the sub-block's scale (and min) to the sums, so it equals x @ W.T to fp32
rounding (tests: within 2e-6 of the sum of the terms' magnitudes), not bit for bit.
Which fields are codes, high bits, scales or fp16 comes from the traits table
(``localllm.quant.gguf_formats``) by field name; only each type's nibble order is known here.
The IQ4 / MXFP4 value tables come from the ``gguf`` package and reach the kernel as
compile-time words (``lut_words``), not as a per-weight memory gather. Packing works on a few
rows at a time, so its transient memory stays small beside a vocabulary-sized matrix.

One kernel body (``_gguf_matmul_kernel``) serves every type: ``FORMAT`` (the GGML type id,
a constexpr) selects the decode. Per weight the decode is a shift and a mask of the code's
word (codes split by constant shifts, put back in order by ``tl.join``s, so they stay in the
thread's registers) and an or with 1.0's exponent (``_code_unit``: the code as the fp32
1 + q / 2^bits, no int->float convert); a sub-block's scale bytes are decoded once per SUB
weights (``_tile_scales``). Three paths, by M:

- decode GEMV (M <= ``GEMV_MAX_M``): fp32 FMAs, no tensor-core tile; each program streams a
  [BLOCK_N rows x K / SPLIT_K] strip of blocks once, and split-K (the last program sums,
  ``split_k_sum``) spreads a layer over every SM;
- a batch of decodes (M <= ``SMALL_M``): one ``tl.dot`` tile holds all M rows, so each weight
  is decoded once per launch, with split-K;
- prefill (M > ``SMALL_M``): the fastest, measured once per shape (``gguf_linear``), of the
  kernel's prefill tiles, dequantize-then-cuBLAS (``gguf_linear_dequant_mm``: the weights
  written in x's dtype by ``_gguf_dequant_kernel``, in row chunks of a bounded scratch) and
  the torch reference.

Measured on an H200 before this layout (2026-12-04): the GEMV at 6-10% of the read roofline,
compute-bound on a per-weight decode through shared-memory layout conversions: 733 SASS
instructions in the sm90 loop for 32 weights a thread (23 a weight, Q4_K, one row). This
layout: 407 for 64 (6.4 a weight; 96 registers, so 5 programs an SM); timed on the H200 the
same day (docs/benchmarks.md: Q4_K M = 1 124.8 -> 33.5 us). bench/aot_check.py compiles every
config for sm80/sm89/sm90; bench/gpu_check.py times them.

``gguf_grouped`` is the mixture-of-experts entry: a stacked [E * N, K] expert weight and rows
sorted by expert (or, for a one-token decode, unsorted), every routed expert's rows in one
launch (``_gguf_grouped_kernel``, the same ``_decode_tile``), with no value read back
(CUDA-graph safe); see its section below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from localllm.kernels._triton import (
    INTERPRET,
    Config,
    capability,
    configs_for,
    dot_fp32,
    gemm_backend_choice,
    gpu_tiles,
    grouped_tile,
    m_bucket,
    make_autotuner,
    next_power_of_2,
    split_k_range,
    split_k_sum,
    splitk_locks,
    tl,
    triton,
    use_triton,
)
from localllm.kernels.awq_gemm import _interleave8
from localllm.quant import gguf_formats as gf

# Inline PTX where the compiled kernel gains from it; the interpreter runs the plain operations.
_ASM = tl.constexpr(not INTERPRET)

# The types the kernels take. Per type, the file's code order: weights of one block come in
# runs of ``run`` bytes, each byte's bit fields (lowest first) holding consecutive runs, as
# ggml's dequantize_row_* reads them: (low-bits run, high-bits run).
_RUNS: dict[str, tuple[int, int]] = {
    "Q4_0": (16, 0),
    "Q4_1": (16, 0),
    "Q5_0": (16, 1),  # qh: bit i of the little-endian uint32 is weight i
    "Q5_1": (16, 1),
    "Q8_0": (32, 0),
    "Q4_K": (32, 0),  # byte i of each 32-byte run: weights 64c + i (low) and 64c + 32 + i (high)
    "Q5_K": (32, 32),  # qh: bit b of byte i is weight 32b + i
    "Q6_K": (64, 32),  # qh: 2-bit field s of byte i in half h is weight 128h + 32s + i
    "IQ4_NL": (16, 0),
    "IQ4_XS": (16, 0),
    "MXFP4": (16, 0),
}
FORMATS: frozenset[str] = frozenset(_RUNS)
"""Traits-table names of the types the GPU kernels multiply as stored."""

_CODE_FIELDS = ("qs", "ql")
_HIGH_FIELDS = ("qh",)
_FP16_FIELDS = ("d", "dmin", "m")
_SCALE_FIELDS = ("scales", "scales_h", "scales_l", "e")
# What a code means before its block's scale: an offset (ggml's "q - 8"), or an index into
# the 16-value table of the IQ4 / MXFP4 types (taken from the gguf package at pack time).
_OFFSET = {"Q4_0": -8, "Q5_0": -16, "Q6_K": -32}
_LUT_TYPES = {"IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_NL", "MXFP4": "MXFP4"}


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    """How one type's block is split into the packed tensors (derived from the traits table)."""

    name: str
    type_id: int
    block_weights: int
    sub_block: int  # weights sharing one scale
    lo_bits: int  # bits per weight in ``codes``
    hi_bits: int  # bits per weight in ``high`` (0: none)
    nd: int  # fp16 values per block in ``d``
    nsc: int  # bytes per block in ``scales``

    def row_bytes(self, k: int) -> int:
        """Bytes the packed tensors hold per row of ``k`` weights (the file's row bytes)."""
        nb = k // self.block_weights
        return k * (self.lo_bits + self.hi_bits) // 8 + nb * (2 * self.nd + self.nsc)


@functools.lru_cache(maxsize=None)
def gpu_layout(name: str) -> GGUFLayout:
    """The packed layout of a type the kernels take; ValueError naming the type otherwise."""
    f = gf.fmt(name)
    if f.name not in FORMATS:
        raise ValueError(f"GGUF type {f.name} has no GPU kernel (the kernels take {', '.join(sorted(FORMATS))})")
    by_kind = {"lo": 0, "hi": 0, "fp16": 0, "scale": 0}
    for field in f.fields:
        kind = ("lo" if field.name in _CODE_FIELDS else "hi" if field.name in _HIGH_FIELDS
                else "fp16" if field.name in _FP16_FIELDS else "scale" if field.name in _SCALE_FIELDS else None)
        assert kind is not None, f"{f.name}: field {field.name} has no place in the GPU layout"
        by_kind[kind] += field.nbytes
    return GGUFLayout(f.name, f.type_id, f.block_weights, f.sub_block, by_kind["lo"] * 8 // f.block_weights,
                      by_kind["hi"] * 8 // f.block_weights, by_kind["fp16"] // 2, by_kind["scale"])


@dataclass(frozen=True, slots=True, eq=False)
class GGUFPacked:
    """One linear's GGUF blocks in the GPU layout (module docstring); all on one device."""

    fmt: str  # traits-table name, e.g. "Q4_K"
    out_features: int  # N
    in_features: int  # K
    codes: torch.Tensor  # int32 [N, K * lo_bits / 32]
    high: torch.Tensor  # int32 [N, K * hi_bits / 32]
    scales: torch.Tensor  # uint8 [N, K / block_weights, nsc]
    d: torch.Tensor  # fp16 [N, K / block_weights, nd]
    lut: torch.Tensor  # fp32 [16]: the IQ4 / MXFP4 code values (the torch reference's); [0] otherwise

    @property
    def layout(self) -> GGUFLayout:
        return gpu_layout(self.fmt)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        """Bytes of the weight tensors (equal to the file's blocks; the 64-byte ``lut`` aside)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.high, self.scales, self.d))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (to register as buffers; ``from_tensors`` rebuilds)."""
        return {"codes": self.codes, "high": self.high, "scales": self.scales, "d": self.d, "lut": self.lut}

    @classmethod
    def from_tensors(cls, fmt: str, out_features: int, in_features: int,
                     tensors: dict[str, torch.Tensor]) -> GGUFPacked:
        return cls(gf.fmt(fmt).name, out_features, in_features, tensors["codes"], tensors["high"],
                   tensors["scales"], tensors["d"], tensors["lut"])


# --- packing (torch ops, on the blocks' device) ------------------------------------------------


def _file_codes(fields: torch.Tensor, bits: int, run: int) -> torch.Tensor:
    """uint8 [R, nb, nbytes] of one code field -> uint8 [R, nb * weights] in weight order: the
    field is runs of ``run`` bytes; each byte's ``8 / bits`` fields hold consecutive runs."""
    r, nb, nbytes = fields.shape
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=fields.device).view(1, 1, 1, -1, 1)
    return ((fields.reshape(r, nb, nbytes // run, 1, run) >> shifts) & ((1 << bits) - 1)).reshape(r, -1)


def _pack_straight(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, K] of ``bits``-bit values -> uint8 [R, K * bits / 8], weight k at bits
    ``bits * (k % per)`` of byte ``k // per``; viewed as int32 (little-endian), word j holds
    weights ``32 / bits * j ..`` from its lowest bits up."""
    r, k = values.shape
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=values.device)
    return (values.view(r, k // per, per) << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: sum == or


# Rows packed at a time: bounds the transient uint8 copies to ~16 M weights (a 128k-row
# vocabulary matrix packs on a GPU without several times its size free).
_PACK_WEIGHTS = 1 << 24


def _unpack_straight(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack_straight``: int32 [N, K * bits / 32] -> int32 [N, K]."""
    n = words.shape[0]
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=words.device)
    return ((words.view(torch.uint8).to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)).reshape(n, -1)


def _table_values(name: str) -> tuple[int, ...]:
    """The 16 code values of an IQ4 / MXFP4 type (the gguf package's tables); () otherwise."""
    table = _LUT_TYPES.get(name)
    if table is None:
        return ()
    from gguf import quants

    return tuple(int(v) for v in getattr(quants, table).kvalues)


def _lut(name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(_table_values(name), dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def lut_words(name: str) -> dict[str, int]:
    """The kernel's LUT0..LUT3 constexprs: the type's 16 int8 code values, 4 to a signed int32
    word (entry q in byte q % 4 of word q // 4); zeros for types without a table."""
    values = _table_values(name) or (0,) * 16
    words = {}
    for i in range(4):
        word = sum((values[4 * i + b] & 0xFF) << (8 * b) for b in range(4))
        words[f"LUT{i}"] = word - (1 << 32) if word >= 1 << 31 else word
    return words


def pack_gguf_blocks(raw: torch.Tensor, fmt: str) -> GGUFPacked:
    """uint8 [N, row_bytes], a linear's rows exactly as the file stores them, -> the GPU layout,
    on ``raw``'s device (torch ops only; no host round trip on CUDA besides the 16-value table).
    Raises ValueError for a type without a kernel or rows that are not whole blocks."""
    layout = gpu_layout(fmt)
    f = gf.fmt(layout.name)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % f.block_bytes:
        raise ValueError(f"{f.name} blocks must be uint8 [rows, whole blocks of {f.block_bytes} bytes], "
                         f"not {raw.dtype} {list(raw.shape)}")
    n, row_bytes = raw.shape
    nb = row_bytes // f.block_bytes
    k = nb * f.block_weights
    dev = raw.device
    codes = torch.empty((n, k * layout.lo_bits // 8), dtype=torch.uint8, device=dev)
    high = torch.empty((n, k * layout.hi_bits // 8), dtype=torch.uint8, device=dev)
    d = torch.empty((n, nb, 2 * layout.nd), dtype=torch.uint8, device=dev)
    scales = torch.empty((n, nb, layout.nsc), dtype=torch.uint8, device=dev)
    lo_run, hi_run = _RUNS[f.name]
    step = max(1, _PACK_WEIGHTS // k)
    for r0 in range(0, n, step):
        blocks = raw[r0:r0 + step].reshape(-1, nb, f.block_bytes)
        offset = d_at = s_at = 0
        for field in f.fields:
            part = blocks[:, :, offset:offset + field.nbytes]
            offset += field.nbytes
            if field.name in _CODE_FIELDS:
                codes[r0:r0 + step] = _pack_straight(_file_codes(part, layout.lo_bits, lo_run), layout.lo_bits)
            elif field.name in _HIGH_FIELDS:
                high[r0:r0 + step] = _pack_straight(_file_codes(part, layout.hi_bits, hi_run), layout.hi_bits)
            elif field.name in _FP16_FIELDS:
                d[r0:r0 + step, :, d_at:d_at + field.nbytes] = part
                d_at += field.nbytes
            else:
                scales[r0:r0 + step, :, s_at:s_at + field.nbytes] = part
                s_at += field.nbytes
    return GGUFPacked(f.name, n, k, _as(codes, torch.int32), _as(high, torch.int32), scales,
                      _as(d, torch.float16), _lut(f.name, dev))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 tensor's bytes as ``dtype`` (last dim shrinks); torch refuses the view when
    that dim is empty, so an empty one is made instead."""
    if t.shape[-1] == 0:
        return torch.empty(t.shape, dtype=dtype, device=t.device)
    return t.view(dtype)


# --- the torch reference ------------------------------------------------------------------------


def _sub_block_scales(p: GGUFPacked) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 (scale, bias) [N, nb, sub-blocks per block]: weight = scale * value + bias, in
    ggml's operation order (the scale a product of exact factors, one rounding in the add)."""
    d = p.d.float()
    s = p.scales.to(torch.int32)
    name = p.fmt
    if name in ("Q4_K", "Q5_K"):  # 6-bit scales and mins, 8 a block
        a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], -1)
        mn = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)
        return d[..., 0:1] * sc.float(), -(d[..., 1:2] * mn.float())
    if name == "Q6_K":
        return d[..., 0:1] * p.scales.view(torch.int8).float(), None
    if name == "IQ4_XS":
        j = torch.arange(8, device=s.device)
        high = s[..., 0:1] | (s[..., 1:2] << 8)
        sc = ((s[..., 2 + j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
        return d[..., 0:1] * (sc - 32).float(), None
    if name == "MXFP4":  # ggml_e8m0_to_fp32_half
        e = s[..., 0:1]
        return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32), None
    return d[..., 0:1], (d[..., 1:2] if p.d.shape[-1] == 2 else None)  # Q4_0..Q8_0, IQ4_NL


def _values(p: GGUFPacked) -> torch.Tensor:
    """fp32 [N, K]: each weight's code as its block scale multiplies it."""
    layout = p.layout
    q = _unpack_straight(p.codes, layout.lo_bits)
    if layout.hi_bits:
        q = q | (_unpack_straight(p.high, layout.hi_bits) << layout.lo_bits)
    if p.fmt == "Q8_0":
        q = (q ^ 0x80) - 0x80  # the byte is int8
    if p.lut.numel():
        return p.lut[q]
    return (q + _OFFSET.get(p.fmt, 0)).float()


def dequantize_packed(p: GGUFPacked) -> torch.Tensor:
    """fp32 [N, K]: the weights, equal to ``gguf.quants.dequantize`` of the file's blocks."""
    layout = p.layout
    n, k = p.out_features, p.in_features
    scale, bias = _sub_block_scales(p)
    v = _values(p).view(n, k // layout.sub_block, layout.sub_block)
    w = scale.reshape(n, -1, 1) * v
    if bias is not None:
        w = w + bias.reshape(n, -1, 1)
    return w.view(n, k)


def dequantize_rows(p: GGUFPacked, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(ids), K] in ``dtype``: the rows ``ids`` (int64, on the weights' device) of the
    weight, for an embedding lookup; torch ops only, no host sync (CUDA-graph safe)."""
    sub = GGUFPacked(p.fmt, int(ids.numel()), p.in_features, p.codes[ids], p.high[ids], p.scales[ids], p.d[ids], p.lut)
    return dequantize_packed(sub).to(dtype)


def gguf_linear_reference(x: torch.Tensor, p: GGUFPacked) -> torch.Tensor:
    """x [..., K] @ dequantize_packed(p).T -> [..., N] in x.dtype (fp32 products on the CPU and
    for fp32 x; in x.dtype on CUDA, as a dense half-precision layer would)."""
    w = dequantize_packed(p)
    if x.dtype == torch.float32 or not x.is_cuda:
        return (x.to(torch.float32) @ w.t()).to(x.dtype)
    return x @ w.to(x.dtype).t()


# --- Triton -------------------------------------------------------------------------------------


@triton.jit
def _table(q, LUT0: tl.constexpr, LUT1: tl.constexpr, LUT2: tl.constexpr, LUT3: tl.constexpr):
    """The int8 table entry q (0..15) as fp32: the 16 entries are compile-time words (4 a word,
    ``lut_words``), picked by q >> 2 and shifted out, so no per-weight memory gather."""
    word = tl.where(q < 8, tl.where(q < 4, LUT0, LUT1), tl.where(q < 12, LUT2, LUT3))
    return ((word << (24 - 8 * (q & 3))) >> 24).to(tl.float32)


@triton.jit
def _is_table(FORMAT: tl.constexpr):
    """IQ4_NL, IQ4_XS, MXFP4: a code indexes a 16-value table instead of being an integer."""
    return FORMAT == 20 or FORMAT == 23 or FORMAT == 39


@triton.jit
def _offset(FORMAT: tl.constexpr):
    """What ggml adds to an integer code before its scale (Q8_0's code is stored as q + 128)."""
    if FORMAT == 8:
        off: tl.constexpr = -128
    elif FORMAT == 2:
        off: tl.constexpr = -8
    elif FORMAT == 6:
        off: tl.constexpr = -16
    elif FORMAT == 14:
        off: tl.constexpr = -32
    else:
        off: tl.constexpr = 0
    return off


@triton.jit
def _code_unit(words, SHIFT: tl.constexpr, hi, HI_SHIFT: tl.constexpr, FORMAT: tl.constexpr,
               LO_BITS: tl.constexpr, HI_BITS: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr,
               LUT2: tl.constexpr, LUT3: tl.constexpr):
    """fp32 of the code c at bits SHIFT.. of each word (its high bits at HI_SHIFT.. of ``hi``):
    for an integer type u = 1 + c / 2^QB (QB = the code's bits; Q8_0's c is q + 128), made
    by moving the code under the mantissa's top bits and or-ing in 1.0's exponent: a shift
    and a lop3, no int->float convert (a quarter-rate instruction); ``_unit_value`` maps u
    back to the integer exactly. For a table type, the table entry itself."""
    if _is_table(FORMAT):
        c = (words >> SHIFT) & ((1 << LO_BITS) - 1)
        u = _table(c, LUT0, LUT1, LUT2, LUT3)
    else:
        POS: tl.constexpr = 23 - LO_BITS - HI_BITS  # the code's lowest bit in the fp32 mantissa
        MASK: tl.constexpr = ((1 << LO_BITS) - 1) << POS
        if SHIFT >= POS:
            moved = words >> (SHIFT - POS)
        else:
            moved = words << (POS - SHIFT)
        if _ASM and LO_BITS == 4 and HI_BITS == 0:  # MASK = 0x780000
            # (moved & MASK) | 1.0f as one lop3: written as two operations, both constants are
            # immediates and ptxas emits two (a lop3 takes one immediate)
            return tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xEA;", "=r,r", [moved], dtype=tl.int32, is_pure=True,
                pack=1,
            ).to(tl.float32, bitcast=True)
        c = moved & MASK
        if HI_BITS > 0:
            HPOS: tl.constexpr = POS + LO_BITS
            HMASK: tl.constexpr = ((1 << HI_BITS) - 1) << HPOS
            if HI_SHIFT >= HPOS:
                c = c | ((hi >> (HI_SHIFT - HPOS)) & HMASK)
            else:
                c = c | ((hi << (HPOS - HI_SHIFT)) & HMASK)
        if FORMAT == 8:  # the byte is int8: q + 128 = byte ^ 0x80
            c = c ^ (0x80 << POS)
        u = (c | 0x3F800000).to(tl.float32, bitcast=True)
    return u


@triton.jit
def _unit_value(u, FORMAT: tl.constexpr, QB: tl.constexpr):
    """The value before the block scale from ``_code_unit``'s u: (u - 1) * 2^QB + offset, each
    step exact (u - 1 is a multiple of 2^-QB below 1); a table entry as it is."""
    if _is_table(FORMAT):
        v = u
    else:
        v = (u - 1.0) * (1 << QB) + _offset(FORMAT)
    return v


@triton.jit
def _tile_units(
    codes_ptr, high_ptr, rows, n_ok, k0, K,
    FORMAT: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr,
    LUT2: tl.constexpr, LUT3: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_K]: ``_code_unit`` of each code, rows ``rows`` (int64 [BLOCK_N, 1]),
    columns k0 .. k0 + BLOCK_K. Each row's codes are one contiguous run (BLOCK_K * LO_BITS / 8
    bytes); a word's codes are split by constant shifts and put back in column order by
    ``tl.join``s (a minor axis in one thread's registers), so no shared-memory layout
    conversion runs per weight (as in the AWQ kernel)."""
    LO_PER: tl.constexpr = 32 // LO_BITS
    NW: tl.constexpr = BLOCK_K // LO_PER
    offs_w = k0 // LO_PER + tl.arange(0, NW)
    w_mask = n_ok[:, None]
    if not EVEN_K:
        w_mask = w_mask & (offs_w < K // LO_PER)[None, :]
    words = tl.load(codes_ptr + rows * (K // LO_PER) + offs_w[None, :], mask=w_mask, other=0)
    hi = words  # no high bits: never read
    if HI_BITS > 0:
        # every word's LO_PER codes share one high-bits word (LO_PER divides 32 / HI_BITS): it is
        # gathered per code word and shifted to that word's first code
        HI_PER: tl.constexpr = 32 // HI_BITS
        first = k0 + tl.arange(0, NW) * LO_PER
        h_mask = n_ok[:, None]
        if not EVEN_K:
            h_mask = h_mask & (first < K)[None, :]
        hw = tl.load(high_ptr + rows * (K // HI_PER) + (first // HI_PER)[None, :], mask=h_mask, other=0)
        hi = hw >> ((first % HI_PER) * HI_BITS)[None, :]
    if LO_PER == 8:
        c0 = _code_unit(words, 0, hi, 0, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c1 = _code_unit(words, 4, hi, HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c2 = _code_unit(words, 8, hi, 2 * HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c3 = _code_unit(words, 12, hi, 3 * HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c4 = _code_unit(words, 16, hi, 4 * HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c5 = _code_unit(words, 20, hi, 5 * HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c6 = _code_unit(words, 24, hi, 6 * HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c7 = _code_unit(words, 28, hi, 7 * HI_BITS, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        u = _interleave8(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N, BLOCK_K)
    else:  # 8-bit codes (Q8_0), 4 a word
        c0 = _code_unit(words, 0, hi, 0, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c1 = _code_unit(words, 8, hi, 0, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c2 = _code_unit(words, 16, hi, 0, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        c3 = _code_unit(words, 24, hi, 0, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3)
        u = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_N, BLOCK_K))  # [.., b, e] = c_{e + 2b}
    return u


@triton.jit
def _tile_scales(
    scales_ptr, d_ptr, rows, n_ok, k0, K,
    FORMAT: tl.constexpr, BW: tl.constexpr, SUB: tl.constexpr, ND: tl.constexpr, NSC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 (scale, bias) [BLOCK_N, BLOCK_K / SUB], one per sub-block: weight = scale * value
    + bias (bias only where ``_has_bias``; zeros otherwise), in ggml's operation order. The
    packed scale bytes are decoded here, once per SUB weights."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    SPB: tl.constexpr = BW // SUB  # sub-blocks per block
    sb = k0 // SUB + tl.arange(0, NSUB)
    blk = (sb // SPB)[None, :]
    j = (sb % SPB)[None, :]
    s_mask = n_ok[:, None] & (sb < K // SUB)[None, :]
    nb = K // BW
    d_at = d_ptr + rows * (nb * ND) + blk * ND
    s_at = scales_ptr + rows * (nb * NSC) + blk * NSC
    bias = tl.zeros((BLOCK_N, NSUB), dtype=tl.float32)
    if FORMAT == 12 or FORMAT == 13:  # Q4_K, Q5_K: 6-bit scale and min per 32, packed in 12 bytes
        lo4 = j % 4
        a = tl.load(s_at + lo4, mask=s_mask, other=0).to(tl.int32)
        b = tl.load(s_at + 4 + lo4, mask=s_mask, other=0).to(tl.int32)
        c = tl.load(s_at + 8 + lo4, mask=s_mask, other=0).to(tl.int32)
        first = j < 4
        sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
        mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
        d = tl.load(d_at, mask=s_mask, other=0.0).to(tl.float32)
        dmin = tl.load(d_at + 1, mask=s_mask, other=0.0).to(tl.float32)
        scale = d * sc.to(tl.float32)
        bias = -(dmin * mn.to(tl.float32))
    elif FORMAT == 14:  # Q6_K: int8 scale per 16
        sc = tl.load(s_at + j, mask=s_mask, other=0).to(tl.int32)
        sc = (sc ^ 0x80) - 0x80
        scale = tl.load(d_at, mask=s_mask, other=0.0).to(tl.float32) * sc.to(tl.float32)
    elif FORMAT == 23:  # IQ4_XS: 6-bit scale per 32 (low 4 bits in scales_l, high 2 in scales_h)
        h = tl.load(s_at, mask=s_mask, other=0).to(tl.int32)
        h = h | (tl.load(s_at + 1, mask=s_mask, other=0).to(tl.int32) << 8)
        low = tl.load(s_at + 2 + j // 2, mask=s_mask, other=0).to(tl.int32)
        sc = ((low >> (4 * (j % 2))) & 15) | (((h >> (2 * j)) & 3) << 4)
        scale = tl.load(d_at, mask=s_mask, other=0.0).to(tl.float32) * (sc - 32).to(tl.float32)
    elif FORMAT == 39:  # MXFP4: E8M0 exponent, halved (ggml_e8m0_to_fp32_half)
        e = tl.load(s_at, mask=s_mask, other=0).to(tl.int32)
        tiny = tl.full((BLOCK_N, NSUB), 0x00200000, tl.int32)
        scale = tl.where(e < 2, tiny << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    else:  # one fp16 scale (and min) per 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL
        scale = tl.load(d_at, mask=s_mask, other=0.0).to(tl.float32)
        if ND == 2:  # Q4_1, Q5_1: + m
            bias = tl.load(d_at + 1, mask=s_mask, other=0.0).to(tl.float32)
    return scale, bias


@triton.jit
def _has_bias(FORMAT: tl.constexpr, ND: tl.constexpr):
    """Whether the type's weights add a per-sub-block bias (Q4_K / Q5_K mins, Q4_1 / Q5_1 m)."""
    return FORMAT == 12 or FORMAT == 13 or ND == 2


@triton.jit
def _decode_tile(
    codes_ptr, high_ptr, scales_ptr, d_ptr, offs_n, n_ok, k0, K,
    FORMAT: tl.constexpr, BW: tl.constexpr, SUB: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr,
    ND: tl.constexpr, NSC: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr, LUT2: tl.constexpr,
    LUT3: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_K]: rows offs_n, columns k0 .. k0 + BLOCK_K of the weight (zero
    outside N x K), each exactly the reference's (scale * value, + bias where the type has
    one). FORMAT is the GGML type id; the branches are resolved at compile time."""
    rows = offs_n.to(tl.int64)[:, None]
    u = _tile_units(codes_ptr, high_ptr, rows, n_ok, k0, K, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3,
                    BLOCK_N, BLOCK_K, EVEN_K)
    v = _unit_value(u, FORMAT, LO_BITS + HI_BITS)
    scale, bias = _tile_scales(scales_ptr, d_ptr, rows, n_ok, k0, K, FORMAT, BW, SUB, ND, NSC, BLOCK_N, BLOCK_K)
    NSUB: tl.constexpr = BLOCK_K // SUB
    w = scale[:, :, None] * tl.reshape(v, (BLOCK_N, NSUB, SUB))
    if _has_bias(FORMAT, ND):
        w = w + bias[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _gemv_tile(
    acc, x_ptr, row0, M, stride_xm, codes_ptr, high_ptr, scales_ptr, d_ptr, offs_n, n_ok, k0, K,
    FORMAT: tl.constexpr, BW: tl.constexpr, SUB: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr,
    ND: tl.constexpr, NSC: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr, LUT2: tl.constexpr,
    LUT3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] + rows row0 .. row0 + BLOCK_M of x times the weight's K tile at
    k0, with fp32 FMAs (decode). Per weight only the code's unit u (``_code_unit``) times x
    is summed; per sub-block, with v = (u - 1) * 2^QB + offset and weight = s * v + b:
    sum_k x_k w_k = s * ((sum x u - sum x) * 2^QB + offset * sum x) + b * sum x. So a weight
    costs a shift, a lop3 and an FMA, and the scales one multiply per SUB weights. The
    reference rounds s * v + b per weight first: the two agree to fp32 rounding (the test's
    2e-6 of the terms' magnitudes), not bit for bit."""
    rows = offs_n.to(tl.int64)[:, None]
    u = _tile_units(codes_ptr, high_ptr, rows, n_ok, k0, K, FORMAT, LO_BITS, HI_BITS, LUT0, LUT1, LUT2, LUT3,
                    BLOCK_N, BLOCK_K, EVEN_K)
    scale, bias = _tile_scales(scales_ptr, d_ptr, rows, n_ok, k0, K, FORMAT, BW, SUB, ND, NSC, BLOCK_N, BLOCK_K)
    NSUB: tl.constexpr = BLOCK_K // SUB
    QB: tl.constexpr = LO_BITS + HI_BITS
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    for i in tl.static_range(BLOCK_M):
        row = row0 + i
        xi = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs_k, mask=k_ok & (row < M), other=0.0).to(tl.float32)
        xu = tl.sum(tl.reshape(u * xi[None, :], (BLOCK_N, NSUB, SUB)), axis=2)
        if _is_table(FORMAT):
            t = scale * xu
        else:
            sx = tl.sum(tl.reshape(xi, (NSUB, SUB)), axis=1)[None, :]
            xv = (xu - sx) * (1 << QB)
            if _offset(FORMAT) != 0:
                xv += _offset(FORMAT) * sx
            t = scale * xv
            if _has_bias(FORMAT, ND):
                t += bias * sx
        part = tl.sum(t, axis=1)
        acc += tl.where(tl.arange(0, BLOCK_M)[:, None] == i, part[None, :], 0.0)
    return acc


@triton.jit
def _gguf_matmul_kernel(
    x_ptr, codes_ptr, high_ptr, scales_ptr, d_ptr, out_ptr, ws_ptr, locks_ptr,
    M, N, K, stride_xm, stride_om,
    M_BUCKET,  # only an autotune key
    FORMAT: tl.constexpr, BW: tl.constexpr, SUB: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr,
    ND: tl.constexpr, NSC: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr, LUT2: tl.constexpr,
    LUT3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kt_lo, kt_hi = split_k_range(K, pid_k, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_lo, kt_hi):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if USE_DOT:
            w = _decode_tile(codes_ptr, high_ptr, scales_ptr, d_ptr, offs_n, n_ok, k0, K, FORMAT, BW, SUB,
                             LO_BITS, HI_BITS, ND, NSC, LUT0, LUT1, LUT2, LUT3, BLOCK_N, BLOCK_K, EVEN_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if DOT_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:  # fp16 or bf16 tensor cores, the weights rounded once to x's type
                acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
        else:  # decode: the tile's codes are unpacked once for each of the BLOCK_M (<= 4) rows
            acc = _gemv_tile(acc, x_ptr, pid_m * BLOCK_M, M, stride_xm, codes_ptr, high_ptr, scales_ptr, d_ptr,
                             offs_n, n_ok, k0, K, FORMAT, BW, SUB, LO_BITS, HI_BITS, ND, NSC, LUT0, LUT1, LUT2,
                             LUT3, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)

    offs_out = offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc, last = split_k_sum(acc, ws_ptr, locks_ptr, pid_k, pid_m, pid_n, offs_m, offs_n, M, N, out_mask,
                                BLOCK_N, SPLIT_K)
        if last:
            tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


GEMV_MAX_M = 4  # decode without tensor cores up to this many rows
# Above GEMV_MAX_M and up to here (a batch of decodes): one dot tile of 16..64 rows holds every
# row, so each weight is decoded once per launch, and split-K fills the GPU. The weights are
# decoded by (N / BLOCK_N) x SPLIT_K programs; a prefill-style grid of M / BLOCK_M x N / BLOCK_N
# tiles without split-K left a 4096-row layer at 32 programs for 132 SMs (H200: 823 tok/s at
# batch 64 against 14504 for the AWQ path).
SMALL_M = 64
MAX_SPLIT_K = 8

# Decode reads each block once: a [BLOCK_N, BLOCK_K] tile is 128-256 contiguous bytes per row of
# 4-bit codes; split-K gives a 4096-row layer several programs per SM.
class _Capped(Config):
    """A Config with an explicit register cap. Without one ptxas picks its own target for some
    of these GEMVs (72 registers for Q5_0 on sm80) and spills a few bytes to reach it; a cap
    of 128 moves the spills to Q5_K at 4 rows; 160 leaves every type and config without
    spills on sm80/sm89/sm90 (bench/aot_check.py --only gguf --match gemv)."""

    __slots__ = ("maxnreg",)

    def __init__(self, kwargs: dict[str, int], num_warps: int, num_stages: int, maxnreg: int = 160) -> None:
        super().__init__(kwargs, num_warps, num_stages)
        self.maxnreg = maxnreg

    def to_triton(self) -> Any:
        return triton.Config(dict(self.kwargs), num_warps=self.num_warps, num_stages=self.num_stages,
                             maxnreg=self.maxnreg)


def launch_options(config: Config) -> dict[str, int]:
    """num_warps, num_stages and (for a capped config) maxnreg: the compile options of a launch."""
    opts = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if isinstance(config, _Capped):
        opts["maxnreg"] = config.maxnreg
    return opts


# GEMV: 64 weights a thread per K step (the loads of one step are what a thread has in flight;
# the scale decode is one sub-block a thread). No software pipelining: the loop has no dot.
_GEMV_CONFIGS = [
    _Capped({"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 4, "GROUP_M": 1}, 4, 1),
    _Capped({"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 8, "GROUP_M": 1}, 4, 1),
    _Capped({"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "GROUP_M": 1}, 8, 1),
    _Capped({"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 4, "GROUP_M": 1}, 4, 1),
]
# One row fits in 96 registers without spilling (every type but the tables: aot_check); left
# to itself ptxas takes up to the 160 cap for its schedule (Q4_K with the inline-asm unpack:
# 159), which leaves 3 programs of 4 warps an SM instead of 5, and a memory-bound GEMV needs
# its loads in flight.
GEMV_ONE_ROW_REGS = 96


def gemv_config(config: Config, block_m: int, layout: GGUFLayout) -> Config:
    """The GEMV launch config for ``block_m`` rows of ``layout``'s type: ``config`` with the
    register cap for that case (``GEMV_ONE_ROW_REGS`` for one row)."""
    if block_m == 1 and layout.name not in _LUT_TYPES:  # the table types spill at 96
        return _Capped(dict(config.kwargs), config.num_warps, config.num_stages, GEMV_ONE_ROW_REGS)
    return config


# Batched decode: BLOCK_M (16..64, all of M) is set per call, as the GEMV's rows are. The
# dequantized fp32 tile sits in registers beside the accumulator: 8 warps for the wider tiles
# keep them under 255 registers a thread without spilling (bench/aot_check.py).
# Register caps: left to itself ptxas held Q8_0's 64-row tile to 128 on sm80/sm89 and spilled;
# the 4-warp tile takes up to 255 there (the table types and Q5_1 spilled at 168).
_SMALL_CONFIGS = [
    _Capped({"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "GROUP_M": 1}, 8, 2, 168),
    _Capped({"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "GROUP_M": 1}, 8, 2, 168),
    _Capped({"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 4, "GROUP_M": 1}, 8, 2, 168),
    _Capped({"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 8, "GROUP_M": 1}, 4, 2, 255),
]
_GEMM_CONFIGS = [
    Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3),
    Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 4, 3),
    Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 8}, 8, 3),
    Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 8}, 8, 4),
]
# The interpreter's defaults: small tiles that still split K, span two K-quant sub-block
# boundaries per tile and (K = 512) two blocks per row.
_INTERPRET_GEMV = Config({"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
_INTERPRET_SMALL = Config({"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1}, 4, 1)
_INTERPRET_GEMM = Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "GROUP_M": 2}, 4, 1)

_tuned: dict[tuple[str, bool], object] = {}


def _path(m: int) -> str:
    return "gemv" if m <= GEMV_MAX_M else "small" if m <= SMALL_M else "gemm"


def small_block_m(m: int) -> int:
    """BLOCK_M of the GEMV and batched-decode launches: all ``m`` rows (a power of 2; at
    least 16 for a dot tile)."""
    return next_power_of_2(m) if m <= GEMV_MAX_M else max(16, next_power_of_2(m))


def _autotuned(x: torch.Tensor, path: str, block_m: int, layout: GGUFLayout) -> object:
    """One autotuner per path (decode GEMV, small-batch dot, prefill GEMM), Hopper or not and
    (GEMV) register cap."""
    table = {"gemv": _GEMV_CONFIGS, "small": _SMALL_CONFIGS, "gemm": _GEMM_CONFIGS}[path]
    if path == "gemv":
        table = [gemv_config(c, block_m, layout) for c in table]
    key = (path, capability(x)[0] >= 9, launch_options(table[0]).get("maxnreg"))
    if key not in _tuned:
        _tuned[key] = make_autotuner(_gguf_matmul_kernel, configs_for(x, table),
                                     key=["M_BUCKET", "N", "K", "FORMAT", "DOT_FP32" if path == "gemm" else "BLOCK_M"])
    return _tuned[key]


def gguf_linear_triton(x: torch.Tensor, p: GGUFPacked, *, config: Config | None = None) -> torch.Tensor:
    """Triton implementation of ``gguf_linear_reference``. ``config`` pins the launch (tests; for
    the GEMV and batched-decode paths without BLOCK_M, which is all of M); without it a GPU
    autotunes once per shape bucket and the interpreter uses small fixed tiles."""
    layout = p.layout
    k, n = p.in_features, p.out_features
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the {p.fmt} weight {k}"
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    path = _path(m)
    consts: dict[str, int | bool] = dict(
        FORMAT=layout.type_id, BW=layout.block_weights, SUB=layout.sub_block, LO_BITS=layout.lo_bits,
        HI_BITS=layout.hi_bits, ND=layout.nd, NSC=layout.nsc, **lut_words(p.fmt), USE_DOT=path != "gemv",
        DOT_FP32=dot_fp32(x),
    )
    if path != "gemm":  # every row in one tile
        consts["BLOCK_M"] = small_block_m(m)
    if config is None and not gpu_tiles(x):
        config = {"gemv": _INTERPRET_GEMV, "small": _INTERPRET_SMALL, "gemm": _INTERPRET_GEMM}[path]
    max_split = config.kwargs["SPLIT_K"] if config is not None else (1 if path == "gemm" else MAX_SPLIT_K)
    if max_split > 1:  # split-K scratch: fp32 partial tiles and per-tile arrival counters
        ws = torch.empty((max_split * m * n,), dtype=torch.float32, device=x.device)
        locks = splitk_locks(x.device, m * triton.cdiv(n, 16))
    else:
        ws = locks = out
    # Types without high bits, fp16 fields or a table pass another tensor: never read.
    high = p.high if p.high.numel() else p.codes
    scales = p.scales if p.scales.numel() else p.codes
    d = p.d if p.d.numel() else p.codes
    args = (x2, p.codes, high, scales, d, out, ws, locks, m, n, k, x2.stride(0), out.stride(0), m_bucket(m))

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        kw = config.kwargs
        assert kw["BLOCK_K"] % layout.sub_block == 0, f"BLOCK_K {kw['BLOCK_K']} splits a {p.fmt} sub-block"
        if path == "gemv":
            config = gemv_config(config, int(consts["BLOCK_M"]), layout)
        _gguf_matmul_kernel[grid](*args, **consts, **kw, EVEN_K=k % kw["BLOCK_K"] == 0, **launch_options(config))
    else:
        _autotuned(x, path, int(consts.get("BLOCK_M", 0)), layout)[grid](*args, **consts)  # type: ignore[index]
    return out.view(*x.shape[:-1], n)


@triton.jit
def _gguf_dequant_kernel(
    codes_ptr, high_ptr, scales_ptr, d_ptr, out_ptr, N, K,
    FORMAT: tl.constexpr, BW: tl.constexpr, SUB: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr,
    ND: tl.constexpr, NSC: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr, LUT2: tl.constexpr,
    LUT3: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """out [N, K] (row-major, out's dtype) = the weights, one [BLOCK_N, BLOCK_K] tile a program:
    ``_decode_tile``, so fp32 output equals ``dequantize_packed`` bit for bit."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = _decode_tile(codes_ptr, high_ptr, scales_ptr, d_ptr, offs_n, n_ok, k0, K, FORMAT, BW, SUB, LO_BITS,
                     HI_BITS, ND, NSC, LUT0, LUT1, LUT2, LUT3, BLOCK_N, BLOCK_K, EVEN_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (offs_k < K)[None, :])


_DEQUANT = Config({"BLOCK_N": 32, "BLOCK_K": 256}, 4, 1)
_INTERPRET_DEQUANT = Config({"BLOCK_N": 16, "BLOCK_K": 64}, 4, 1)


def dequantize_triton(p: GGUFPacked, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in ``dtype``: ``dequantize_packed`` by one Triton launch (fp32: bit for bit the
    same; half precision: those weights rounded once). For prefill's dequantize-then-cuBLAS."""
    layout = p.layout
    n, k = p.out_features, p.in_features
    out = torch.empty((n, k), dtype=dtype, device=p.device)
    if n == 0 or k == 0:
        return out
    config = _DEQUANT if gpu_tiles(p.codes) else _INTERPRET_DEQUANT
    kw = config.kwargs
    high = p.high if p.high.numel() else p.codes
    scales = p.scales if p.scales.numel() else p.codes
    d = p.d if p.d.numel() else p.codes
    grid = (triton.cdiv(n, kw["BLOCK_N"]), triton.cdiv(k, kw["BLOCK_K"]))
    _gguf_dequant_kernel[grid](
        p.codes, high, scales, d, out, n, k, FORMAT=layout.type_id, BW=layout.block_weights, SUB=layout.sub_block,
        LO_BITS=layout.lo_bits, HI_BITS=layout.hi_bits, ND=layout.nd, NSC=layout.nsc, **lut_words(p.fmt), **kw,
        EVEN_K=k % kw["BLOCK_K"] == 0, **launch_options(config))
    return out


def row_slice(p: GGUFPacked, lo: int, hi: int) -> GGUFPacked:
    """Rows lo .. hi of the weight: views, no copy."""
    rows = slice(lo, hi)
    return GGUFPacked(p.fmt, len(range(lo, min(hi, p.out_features))), p.in_features, p.codes[rows], p.high[rows],
                      p.scales[rows], p.d[rows], p.lut)


# Prefill's dequantize-then-cuBLAS writes the weights in x's dtype to a scratch of at most this
# many weights at a time (rows in chunks): 128 MB in bf16, below what the planner reserves for
# the GEMM choice (12 bytes a weight of the largest decoder matrix: hardware/planner.py
# _reserve), and a vocabulary-sized head (an 8B's 128k x 4096) never takes this path at all.
DEQUANT_CHUNK_WEIGHTS = 64 * 2**20
# The reference dequantizes in fp32 torch ops (12 bytes a weight of temporaries): timed only
# up to this size, as the planner's reserve allows.
TORCH_CANDIDATE_MAX_WEIGHTS = 64 * 2**20


def gguf_linear_dequant_mm(x: torch.Tensor, p: GGUFPacked) -> torch.Tensor:
    """x @ W.T by dequantizing W to x's dtype (``dequantize_triton``, ``DEQUANT_CHUNK_WEIGHTS``
    at a time) and one dense matmul (cuBLAS) per chunk: for prefill-sized M, where the
    tensor cores' work outweighs decoding the blocks once."""
    k, n = p.in_features, p.out_features
    x2 = x.reshape(-1, k)
    step = max(1, DEQUANT_CHUNK_WEIGHTS // max(1, k))
    if step >= n:
        return (x2 @ dequantize_triton(p, x.dtype).t()).view(*x.shape[:-1], n)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, step):
        out[:, n0:n0 + step] = x2 @ dequantize_triton(row_slice(p, n0, n0 + step), x.dtype).t()
    return out.view(*x.shape[:-1], n)


def gguf_linear(x: torch.Tensor, p: GGUFPacked) -> torch.Tensor:
    """y = x @ W.T for W in GGUF blocks; x: [..., K] fp16/bf16/fp32 -> [..., N] in x.dtype.

    On CUDA (and in a rehearsal): up to ``SMALL_M`` rows (decode, batched decode) the Triton
    kernel, which reads the blocks once; above, the fastest of the kernel's prefill GEMM,
    dequantize-then-cuBLAS (``gguf_linear_dequant_mm``) and the torch reference, measured
    once per shape (``gemm_backend_choice``); elsewhere the torch reference.
    """
    if use_triton(x):
        k, n = p.in_features, p.out_features
        m = x.numel() // k if k else 0
        if m <= SMALL_M:
            return gguf_linear_triton(x, p)
        key = ("gguf", p.fmt, m_bucket(m), n, k, x.dtype, x.device.index)
        candidates = {"triton": lambda: gguf_linear_triton(x, p), "dequant": lambda: gguf_linear_dequant_mm(x, p)}
        if n * k <= TORCH_CANDIDATE_MAX_WEIGHTS:
            candidates["torch"] = lambda: gguf_linear_reference(x, p)
        choice = gemm_backend_choice(key, candidates)
        if choice == "triton":
            return gguf_linear_triton(x, p)
        if choice == "dequant":
            return gguf_linear_dequant_mm(x, p)
    return gguf_linear_reference(x, p)


# --- grouped: the routed experts of a mixture of experts, one launch per projection --------------
#
# A MoE layer's experts are one stacked weight [E * N, K] in one block type (``GGUFPacked`` of
# E * N rows; expert e's rows are e * N .. (e + 1) * N, as the file stacks them), and its rows
# of activations come sorted by expert: expert e's rows are ``offsets[e] .. offsets[e + 1]``.
# One launch runs every expert that got rows: the grid's first axis walks tiles of BLOCK_M rows
# that never straddle two experts (a table built on the device, ``grouped_tiles``, so nothing
# is read back: CUDA-graph safe), each program decoding its expert's [BLOCK_N, K] strip of
# blocks once for the tile's rows. A tile past the last expert's rows exits at once. No split-K:
# a decode step's T * top_k tiles times N / BLOCK_N strips already fill a GPU. With very few
# rows (a one-token decode: ``per_row_routing``) the rows stay in (token, k) order and each is
# its own tile naming its expert (``PER_ROW``): the sort and the tile table would cost more
# launches than the projections (first H200 run: 186 -> 57 us for a Qwen3-30B-A3B layer).


@triton.jit
def _gguf_grouped_kernel(
    x_ptr, codes_ptr, high_ptr, scales_ptr, d_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    N, K, stride_xm, stride_om,
    FORMAT: tl.constexpr, BW: tl.constexpr, SUB: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr,
    ND: tl.constexpr, NSC: tl.constexpr, LUT0: tl.constexpr, LUT1: tl.constexpr, LUT2: tl.constexpr,
    LUT3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr, PER_ROW: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if PER_ROW:  # rows unsorted, tile i is row i of expert tile_expert[i] (a decode's few rows)
        row0 = tile.to(tl.int64)
        row_end = row0 + 1
    else:
        if e < 0:  # past the routed rows
            return
        row0 = tl.load(tile_row_ptr + tile).to(tl.int64)
        row_end = tl.load(offsets_ptr + e + 1).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < row_end
    offs_nl = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_nl < N
    offs_n = e.to(tl.int64) * N + offs_nl  # the expert's rows of the stacked weight
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if USE_DOT:
            w = _decode_tile(codes_ptr, high_ptr, scales_ptr, d_ptr, offs_n, n_ok, k0, K, FORMAT, BW, SUB,
                             LO_BITS, HI_BITS, ND, NSC, LUT0, LUT1, LUT2, LUT3, BLOCK_N, BLOCK_K, EVEN_K)
            x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
        else:  # a few rows per expert (decode): gguf_linear's GEMV tile, rows up to the expert's end
            acc = _gemv_tile(acc, x_ptr, row0, row_end, stride_xm, codes_ptr, high_ptr, scales_ptr, d_ptr,
                             offs_n, n_ok, k0, K, FORMAT, BW, SUB, LO_BITS, HI_BITS, ND, NSC, LUT0, LUT1, LUT2,
                             LUT3, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    offs_out = offs_m.to(tl.int64)[:, None] * stride_om + offs_nl[None, :]
    tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Fixed launches, no autotuning (yet): rows per expert decide the path, as gguf_linear's M does.
# The FMA path is gguf_linear's GEMV tile (its register cap too) at 1, 2 or 4 rows a tile (the
# rows an expert gets: a tile of 4 for one row did 4x the FMAs, which a decode's memory-bound
# step still paid for: the H200's Qwen3-30B-A3B-shaped layer at 16 tokens ran at 6% of the read
# roofline); the dot tiles its small-M and prefill ones without split-K.
GROUPED_GEMV_ROWS = 4  # total routed rows per expert on average up to here: the FMA path
GROUPED_SMALL_ROWS = 32  # and up to here the 16-row dot tile
# 16 x 256 tiles, 2 warps, 2 stages: the H200's best or near it for Q4_K, Q6_K and MXFP4 experts
# at 1 and 16 tokens (2026-12-04 sweep of 19 tiles: 1.16-1.61x the 32 x 128, 4-warp, 3-stage tile)
_GROUPED_GEMV = {m: _Capped({"BLOCK_M": m, "BLOCK_N": 16, "BLOCK_K": 256}, 2, 2) for m in (1, 2, 4)}
_GROUPED_SMALL = Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3)
_GROUPED_GEMM = Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3)
GROUPED_CONFIGS = {**{f"gemv{m}": c for m, c in _GROUPED_GEMV.items()}, "small": _GROUPED_SMALL, "gemm": _GROUPED_GEMM}
_INTERPRET_GROUPED = {"gemv": Config({"BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 64}, 4, 1),
                      "small": Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, 4, 1)}


def grouped_path(rows: int, experts: int) -> str:
    """The launch a grouped call of ``rows`` routed rows over ``experts`` experts takes, by
    the rows an expert gets if they spread over as many experts as they can (the host does
    not read the routing)."""
    per_expert = rows / max(1, min(rows, experts))
    return "gemv" if per_expert <= GROUPED_GEMV_ROWS else "small" if per_expert <= GROUPED_SMALL_ROWS else "gemm"


def grouped_config(rows: int, experts: int, on_gpu: bool) -> Config:
    """The tiles of a grouped call (``grouped_path``'s; on the FMA path as many rows a tile
    as an expert gets on average, rounded up to 1, 2 or 4)."""
    path = grouped_path(rows, experts)
    if not on_gpu:
        return _INTERPRET_GROUPED["gemv" if path == "gemv" else "small"]
    if path == "gemv":
        return _GROUPED_GEMV[next_power_of_2(-(-rows // max(1, min(rows, experts))))]
    return _GROUPED_SMALL if path == "small" else _GROUPED_GEMM


def per_row_routing(tokens: int, top_k: int, experts: int) -> bool:
    """Whether a MoE call of ``tokens`` rows routed to ``top_k`` of ``experts`` experts runs
    its (token, k) rows unsorted, each its own one-row tile: with so few rows an expert is
    rarely chosen twice, and the sort, the expert boundaries and the tile table (a dozen small
    launches per projection, most of a one-token decode's MoE time on an H200) are not needed."""
    return tokens * top_k <= max(top_k, experts // 8)


def expert_slice(p: GGUFPacked, experts: int, e: int) -> GGUFPacked:
    """Expert ``e``'s rows of a stacked weight: views, no copy."""
    n = p.out_features // experts
    rows = slice(e * n, (e + 1) * n)
    return GGUFPacked(p.fmt, n, p.in_features, p.codes[rows], p.high[rows], p.scales[rows], p.d[rows], p.lut)


def grouped_tiles(offsets: torch.Tensor, block_m: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert int32, first row int64) of each of ``max_tiles`` tiles of ``block_m`` rows over
    rows sorted by expert (``offsets`` int64 [E + 1]); expert -1 past the last tile. Torch ops
    on the offsets' device, no value read back."""
    experts = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    slots = torch.arange(max_tiles, device=offsets.device, dtype=ends.dtype)
    e = torch.searchsorted(ends, slots, right=True)
    ec = e.clamp(max=experts - 1)
    row0 = offsets.index_select(0, ec) + (slots - (ends - tiles).index_select(0, ec)) * block_m
    return torch.where(e < experts, ec, -1).to(torch.int32), row0


@dataclass(frozen=True, slots=True, eq=False)
class GroupedRouting:
    """Where the rows of the grouped calls of one MoE layer go; made once by ``route_rows``
    and shared by its projections (same rows, same experts, so the same tiles).

    Per row (``offsets`` None): rows in (token, k) order, row i expert ``tile_expert[i]``,
    one tile each. Sorted: rows sorted by expert, expert e's rows ``offsets[e]`` up to
    ``offsets[e + 1]``, tile t's expert ``tile_expert[t]`` (-1: unused) from row ``tile_row[t]``."""

    experts: int
    rows: int
    config: Config
    tile_expert: torch.Tensor
    tile_row: torch.Tensor | None = None
    offsets: torch.Tensor | None = None


def route_rows(rows: int, experts: int, on_gpu: bool, *, offsets: torch.Tensor | None = None,
               row_expert: torch.Tensor | None = None) -> GroupedRouting:
    """The routing of ``rows`` rows: sorted by expert (``offsets`` int64 [E + 1]) or per row
    (``row_expert`` [rows], each row's expert). Device ops only, nothing read back."""
    if row_expert is not None:
        one = _GROUPED_GEMV[1] if on_gpu else Config({**_INTERPRET_GROUPED["gemv"].kwargs, "BLOCK_M": 1}, 4, 1)
        return GroupedRouting(experts, rows, one, row_expert)
    assert offsets is not None and offsets.numel() == experts + 1
    config = grouped_config(rows, experts, on_gpu)
    bm = config.kwargs["BLOCK_M"]
    max_tiles = min(rows, triton.cdiv(rows, bm) + experts)  # every tile but the last of each expert is full
    offsets = offsets.to(torch.int64)
    tile_expert, tile_row = grouped_tiles(offsets, bm, max_tiles)
    return GroupedRouting(experts, rows, config, tile_expert, tile_row, offsets)


def gguf_grouped_triton(x: torch.Tensor, p: GGUFPacked, routing: GroupedRouting, *,
                        config: Config | None = None) -> torch.Tensor:
    """[R, N] = for each row r of x [R, K], x[r] @ W_e.T with e its expert (``routing``),
    where ``p`` stacks the ``routing.experts`` weights W_e [N, K]. One launch. ``config``
    pins the tiles (tests; its BLOCK_M must be the routing's)."""
    layout = p.layout
    experts = routing.experts
    k, n = p.in_features, p.out_features // experts
    assert x.dim() == 2 and x.shape[1] == k, f"x is {list(x.shape)}, the {p.fmt} experts take {k} features"
    assert p.out_features % experts == 0 and x.shape[0] == routing.rows
    if x.stride(-1) != 1:
        x = x.contiguous()
    r = x.shape[0]
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0 or n == 0:
        return out
    config = config or routing.config
    kw = config.kwargs
    assert kw["BLOCK_K"] % layout.sub_block == 0, f"BLOCK_K {kw['BLOCK_K']} splits a {p.fmt} sub-block"
    assert kw["BLOCK_M"] == routing.config.kwargs["BLOCK_M"], "the routing's tiles are of its BLOCK_M rows"
    per_row = routing.offsets is None
    high = p.high if p.high.numel() else p.codes
    scales = p.scales if p.scales.numel() else p.codes
    d = p.d if p.d.numel() else p.codes
    tile_row = routing.tile_row if routing.tile_row is not None else routing.tile_expert
    offsets = routing.offsets if routing.offsets is not None else routing.tile_expert
    consts: dict[str, int | bool] = dict(
        FORMAT=layout.type_id, BW=layout.block_weights, SUB=layout.sub_block, LO_BITS=layout.lo_bits,
        HI_BITS=layout.hi_bits, ND=layout.nd, NSC=layout.nsc, **lut_words(p.fmt),
        USE_DOT=kw["BLOCK_M"] >= 16, DOT_FP32=dot_fp32(x), EVEN_K=k % kw["BLOCK_K"] == 0, PER_ROW=per_row,
    )
    grid = (routing.tile_expert.numel(), triton.cdiv(n, kw["BLOCK_N"]))
    _gguf_grouped_kernel[grid](x, p.codes, high, scales, d, out, routing.tile_expert, tile_row, offsets,
                               n, k, x.stride(0), out.stride(0), **consts, **kw, **launch_options(config))
    return out


def gguf_grouped_reference(x: torch.Tensor, p: GGUFPacked, routing: GroupedRouting) -> torch.Tensor:
    """``gguf_grouped_triton``'s torch reference: one ``gguf_linear_reference`` per expert
    with rows (reads the routing back: not for a captured graph)."""
    experts = routing.experts
    out = torch.empty((x.shape[0], p.out_features // experts), dtype=x.dtype, device=x.device)
    if routing.offsets is None:
        for i, e in enumerate(routing.tile_expert.tolist()):
            out[i:i + 1] = gguf_linear_reference(x[i:i + 1], expert_slice(p, experts, e))
        return out
    bounds = routing.offsets.tolist()
    for e in range(experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = gguf_linear_reference(x[lo:hi], expert_slice(p, experts, e))
    return out


def gguf_grouped(x: torch.Tensor, p: GGUFPacked, routing: GroupedRouting) -> torch.Tensor:
    """The routed experts' rows through their stacked GGUF weight: the Triton launch on CUDA
    (and in a rehearsal), the torch reference elsewhere."""
    if use_triton(x):
        return gguf_grouped_triton(x, p, routing)
    return gguf_grouped_reference(x, p, routing)
