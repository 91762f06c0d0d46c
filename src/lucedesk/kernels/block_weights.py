"""GGUF blocks held on a GPU (kernels/blocks.py's planes, multiplied by blocks_triton.py's
kernels): a matmul weight (`BlockWeight`), a mixture's experts (`GroupedBlockWeight`) and
the embedding table's rows. A fused projection whose parts differ in type (q|k in Q4_K, v in
Q6_K) is held as runs along N, one type each, each run writing its columns of one output."""

from __future__ import annotations

import torch
import triton

from lucedesk.kernels.blocks import IQ4_VALUES, KINDS, Planes, dequantize_planes
from lucedesk.kernels.blocks_triton import (
    ACTIVATIONS,
    Tiles,
    _block_matmul_kernel,
    _block_rows_kernel,
    _sum_splits_kernel,
    interpreting,
    tiles_for,
)
from lucedesk.kernels.checks import require
from lucedesk.kernels.moe_triton import tile_table
from lucedesk.kernels.triton_numerics import interpreting_bf16

DOT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def launch_constants(kind: str, dtype: torch.dtype, tiles: Tiles, grouped: bool, act: int,
                     bias: bool, interpret: bool | None = None) -> dict:  # fmt: skip
    """The matmul kernel's constexprs for one launch (what compile_targets compiles too,
    with `interpret` False)."""
    import triton.language as tl

    # Under Triton's interpreter half-type tiles are widened to float32 (exact) and each
    # value the GPU rounds to bf16 rounded by round_to_bf16 (attention_triton's case).
    bf16 = interpreting_bf16(dtype, interpret)
    emulate = bf16 or (interpreting(interpret) and dtype == torch.float16)
    dot = tl.float32 if emulate or dtype == torch.float32 else getattr(tl, DOT[dtype])
    return dict(
        KIND=KINDS[kind], BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, SPLITS=tiles.splits,
        GROUPED=grouped, ACT=act, HAS_BIAS=bias, DOT_DTYPE=dot, ROUND=1 if bf16 else 2 * emulate,
    )  # fmt: skip


def _lut(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)


def _matmul(
    x: torch.Tensor,
    p: Planes,
    lut: torch.Tensor,
    out: torch.Tensor,
    col0: int,
    act: int = 0,
    bias: torch.Tensor | None = None,
    groups: tuple | None = None,
    limit: float = 0.0,
    alpha: float = 0.0,
    tiles: Tiles | None = None,
) -> None:
    """out[:, col0 : col0 + N'] = x @ w.T (N' = N, or N / 2 with act) for planes `p` of one
    [N, K] weight (`groups`: moe_triton.tile_table's (expert, row, stop, count, bound) over
    experts stacked along the planes' rows, N each)."""
    m, k = x.shape
    n = p.shape[0] if groups is None else bias_rows(p, groups)
    require(x.stride(1) == 1 and out.stride(1) == 1, "x and out need dense rows")
    tiles = tiles or tiles_for(m, n, k, groups is not None, x.dtype)
    if act:
        tiles = tiles._replace(splits=1)
    width = n // 2 if act else n
    split_k = triton.cdiv(triton.cdiv(k, tiles.splits), tiles.bk) * tiles.bk
    part = x
    if tiles.splits > 1:
        part = torch.empty(tiles.splits, m, n, dtype=torch.float32, device=x.device)
    expert, rows, stop, count, bound = (groups or (x, x, x, x, triton.cdiv(m, tiles.bm)))[:5]
    constants = launch_constants(p.kind, x.dtype, tiles, groups is not None, act, bias is not None)
    grid = (bound, triton.cdiv(width, tiles.bn), tiles.splits)
    _block_matmul_kernel[grid](
        x, out, part, *p[1:], lut, x if bias is None else bias,
        expert, rows, stop, count,
        m, n, k, x.stride(0), out.stride(0), col0, split_k, limit, alpha, **constants,
        num_warps=tiles.warps,
    )  # fmt: skip
    if tiles.splits > 1:
        _sum_splits_kernel[(m, triton.cdiv(n, 128))](
            part, out, m, n, out.stride(0), col0,
            SPLITS=tiles.splits, BN=128, ROUND=constants["ROUND"],
        )  # fmt: skip


def bias_rows(p: Planes, groups: tuple) -> int:
    """The rows one expert has in grouped planes (each plane's rows: experts x N)."""
    return p.codes.shape[0] // groups[5]


class BlockWeight:
    """A [N, K] weight as runs of planes along N (one GGUF type each), on one device."""

    KIND = "blocks"

    def __init__(self, runs: list[Planes]) -> None:
        require(len({r.shape[1] for r in runs}) == 1, "runs of one weight share K")
        self.runs = runs
        self.shape = (sum(r.shape[0] for r in runs), runs[0].shape[1])
        self.lut = _lut(runs[0].codes.device)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)

    @property
    def device(self) -> torch.device:
        return self.runs[0].codes.device

    def _check(self, x: torch.Tensor) -> torch.Tensor:
        require(x.dim() == 2 and x.shape[1] == self.shape[1], f"x must be [M, {self.shape[1]}]")
        require(x.device == self.device, f"x is on {x.device}, the weight on {self.device}")
        require(x.dtype in DOT, f"x must be float32, bfloat16 or float16, got {x.dtype}")
        return x if x.stride(1) == 1 else x.contiguous()

    def __call__(self, x: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
        """x: [M, K] -> [M, N] in x's dtype (`tiles`: blocks_triton.tiles_for's, unless
        given: the tests run a GPU's tiles in the interpreter too)."""
        x = self._check(x)
        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype, device=x.device)
        col = 0
        for run in self.runs:
            if x.shape[0]:
                _matmul(x, run, self.lut, out, col, tiles=tiles)
            col += run.shape[0]
        return out

    def gated(self, x: torch.Tensor, c, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """act(x @ gate.T) * (x @ up.T) for a gate|up weight (gate rows first) in one pass,
        by the family's activation (c: a ModelConfig); None where its halves are not one run
        (the caller runs the matmul and the activation apart)."""
        if len(self.runs) != 1 or c.hidden_act not in ACTIVATIONS:
            return None
        x = self._check(x)
        out = torch.empty(x.shape[0], self.shape[0] // 2, dtype=x.dtype, device=x.device)
        if x.shape[0]:
            _matmul(
                x, self.runs[0], self.lut, out, 0, ACTIVATIONS[c.hidden_act], bias,
                limit=c.swiglu_limit, alpha=c.swiglu_alpha,
            )  # fmt: skip
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's rows `ids` (an embedding lookup): [T] -> [T, K] in `dtype`."""
        require(len(self.runs) == 1, "an embedding table is one run")
        p = self.runs[0]
        ids = ids.to(torch.int64).contiguous()
        k = self.shape[1]
        out = torch.empty(ids.shape[0], k, dtype=dtype, device=ids.device)
        if ids.shape[0]:
            bk = 256 if k % 256 == 0 else 32
            constants = launch_constants(p.kind, dtype, Tiles(1, 1, bk, 1), False, 0, False)
            _block_rows_kernel[(ids.shape[0], k // bk)](
                ids, out, *p[1:], self.lut, k,
                KIND=constants["KIND"], BK=bk, ROUND=constants["ROUND"],
            )  # fmt: skip
        return out

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the values the blocks hold."""
        return torch.cat([dequantize_planes(r.to("cpu")) for r in self.runs]).to(self.device)


class GroupedBlockWeight:
    """The [N, K] weights of `num_experts` experts as BlockWeight holds one: runs along N,
    each run's planes the experts' rows one expert after the other (expert e's at
    e * n .. e * n + n - 1 for a run of n rows an expert)."""

    KIND = "blocks"
    SORTED_PAIRS = True  # takes (row, expert) pairs sorted by expert, with counts

    def __init__(self, num_experts: int, runs: list[Planes]) -> None:
        require(all(r.shape[0] % num_experts == 0 for r in runs), "runs hold whole experts")
        self.num_experts = num_experts
        self.runs = runs
        self.shape = (sum(r.shape[0] for r in runs) // num_experts, runs[0].shape[1])
        self.lut = _lut(runs[0].codes.device)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)

    def _groups(self, counts: torch.Tensor, num_pairs: int) -> tuple:
        expert, rows, stop, count, bound = tile_table(counts, num_pairs, 16)
        return expert, rows, stop, count, bound, self.num_experts

    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [P, K] pairs sorted by expert, counts [E] -> [P, N] (+ each pair's expert's
        bias [E, N])."""
        require(x.dim() == 2 and x.shape[1] == self.shape[1], f"x must be [P, {self.shape[1]}]")
        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype, device=x.device)
        if x.shape[0] == 0:
            return out
        groups, col = self._groups(counts, x.shape[0]), 0
        for run in self.runs:
            n = run.shape[0] // self.num_experts
            part = None if bias is None else bias[:, col : col + n].contiguous()
            _matmul(x.contiguous(), run, self.lut, out, col, 0, part, groups)
            col += n
        return out

    def gated(
        self, x: torch.Tensor, counts: torch.Tensor, c, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """act(gate) * up of each pair in one pass (see BlockWeight.gated); None where the
        halves are not one run."""
        if len(self.runs) != 1 or c.hidden_act not in ACTIVATIONS:
            return None
        out = torch.empty(x.shape[0], self.shape[0] // 2, dtype=x.dtype, device=x.device)
        if x.shape[0]:
            _matmul(
                x.contiguous(), self.runs[0], self.lut, out, 0, ACTIVATIONS[c.hidden_act],
                bias, self._groups(counts, x.shape[0]), c.swiglu_limit, c.swiglu_alpha,
            )  # fmt: skip
        return out

    def dequantize(self, expert: int) -> torch.Tensor:
        """One expert's [N, K] float32 weight."""
        parts = []
        for run in self.runs:
            n = run.shape[0] // self.num_experts
            rows = torch.arange(expert * n, (expert + 1) * n, device=run.codes.device)
            parts.append(dequantize_planes(run.rows(rows).to("cpu")))
        return torch.cat(parts)
