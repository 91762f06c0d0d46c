"""TorchSeqEngine: runs a StepPlan as one ragged forward over the paged KV cache."""

from __future__ import annotations

import torch

from lucedesk.engine.models.decoder import DecoderModel
from lucedesk.engine.plan import StepPlan
from lucedesk.engine.sampler import Sampler
from lucedesk.engine.seq_engine import StepResult
from lucedesk.kernels import Kernels, get_kernels
from lucedesk.kernels.kv_storage import LayerKV
from lucedesk.kernels.metadata import AttentionMetadata


class PagedAttention:
    """The attention object the model calls per layer for one step: writes the new K/V rows
    into their blocks, then attends over each sequence's blocks."""

    def __init__(
        self,
        kernels: Kernels,
        caches: list[LayerKV],
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        self.kernels = kernels
        self.caches = caches
        self.meta = meta
        self.scale = scale

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = self.caches[layer_idx]
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
        self.kernels.write_kv(k, v, kv.k, kv.v, self.meta.slot_mapping, **scales)
        return self.kernels.attention(q, kv.k, kv.v, self.meta, self.scale, window, sinks, **scales)

    def cache_rows(
        self, layer_idx: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The layer's caches and this step's rows in them, when they hold `dtype` as is
        (an 8-bit cache quantizes what it is handed)."""
        kv = self.caches[layer_idx]
        if kv.k_scale is not None or kv.k.dtype != dtype:
            return None
        return kv.k, kv.v, self.meta.slot_mapping

    def attend(
        self, layer_idx: int, q: torch.Tensor, window: int = 0, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        kv = self.caches[layer_idx]
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
        return self.kernels.attention(q, kv.k, kv.v, self.meta, self.scale, window, sinks, **scales)

    def stack_inputs(self) -> tuple[list[LayerKV], AttentionMetadata, float]:
        return self.caches, self.meta, self.scale


class TorchSeqEngine:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        kernels: str = "torch",
        device: torch.device | str = "cpu",
        kv_dtype: str = "dtype",
    ) -> None:
        c = model.config
        self.model = model
        self.num_blocks = num_blocks
        self.vocab_size = c.vocab_size
        self.block_size = block_size
        self.device = torch.device(device)
        self.kernels = get_kernels(kernels)
        model.use_kernels(self.kernels)
        shape = (c.num_kv_heads, num_blocks, block_size, c.head_dim)
        # kv_dtype "dtype": K/V in the model dtype; "int8": 8-bit rows with a float32 scale
        # per token and KV head (kernels/kv_storage.py).
        self.caches = [LayerKV.allocate(shape, model.dtype, kv_dtype, device) for _ in model.layers]
        self.scale = c.attention_scale
        self.sampler = Sampler(self.kernels.greedy)

    def forget(self, request_ids: list[str]) -> None:
        self.sampler.forget(request_ids)

    @property
    def block_bytes(self) -> int:
        """Bytes one KV block holds: every layer's K and V (and their scales)."""
        return sum(t.nbytes // t.shape[1] for kv in self.caches for t in kv.tensors())

    def kv_layout(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each cache tensor's dtype and its shape for one block (the block axis, the
        second, left out), layer by layer: what a copy of blocks holds."""
        return [(t.dtype, (t.shape[0], *t.shape[2:])) for kv in self.caches for t in kv.tensors()]

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """A copy of these blocks' K/V in host memory: one tensor per cache tensor (see
        kv_layout), the blocks along the second axis in the order given."""
        index = torch.tensor(block_ids, device=self.device)
        return [t.index_select(1, index).cpu() for kv in self.caches for t in kv.tensors()]

    def write_blocks(self, block_ids: list[int], tensors: list[torch.Tensor]) -> None:
        """Put a copy taken by read_blocks (of a model with this kv_layout) into blocks."""
        index = torch.tensor(block_ids, device=self.device)
        targets = [t for kv in self.caches for t in kv.tensors()]
        for target, source in zip(targets, tensors, strict=True):
            target.index_copy_(1, index, source.to(target.device))

    def execute(self, plan: StepPlan) -> StepResult:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        # A decode row with a draft is one decode sequence of 1 + k query rows, each attending
        # to the cache up to its own position (the draft's K/V written first): the logits of
        # every position are what plain decode steps would compute there.
        for row in plan.decodes:
            input_ids += row.request.token_ids(row.start, row.start + 1) + list(row.draft)
            positions += range(row.start, row.start + row.num_tokens)
            query_lens.append(row.num_tokens)
            seq_lens.append(row.start + row.num_tokens)
            tables.append(row.request.block_ids)
        num_decodes = len(query_lens)
        for row in plan.prefills:
            input_ids += row.request.token_ids(row.start, row.start + row.num_tokens)
            positions += range(row.start, row.start + row.num_tokens)
            query_lens.append(row.num_tokens)
            seq_lens.append(row.start + row.num_tokens)
            tables.append(row.request.block_ids)
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=self.block_size,
            num_decodes=num_decodes,
            device=self.device,
        )
        attention = PagedAttention(self.kernels, self.caches, meta, self.scale)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                attention,
            )  # [num_tokens, H]
            # The LM head runs only on decode rows (every position of a draft) and on the
            # last row of finishing chunks.
            plain: list[int] = []  # logits rows sampled as usual, one per row
            drafts: list[tuple[int, int]] = []  # (first logits row, index into plan.rows)
            want: list[int] = []
            row_start = 0
            for i, row in enumerate(plan.rows):
                if row.sample and row.draft:
                    drafts.append((len(want), i))
                    want += range(row_start, row_start + row.num_tokens)
                elif row.sample:
                    plain.append(len(want))
                    want.append(row_start + row.num_tokens - 1)
                row_start += row.num_tokens
            if not want:
                return StepResult({}, {})
            logits = self.model.compute_logits(hidden[want])  # [R, vocab]
            sampling = [r.request for r in plan.rows if r.sample and not r.draft]
            result = StepResult({}, {})
            if sampling:
                # Every row plain (no drafts): the logits as they are, not a copy of them.
                rows = logits if len(plain) == len(want) else logits[plain]
                result = self.sampler.sample(rows, sampling)
            if not drafts:
                return result
            # Draft rows ask for no logprobs (the engine's rule).
            accepted = {}
            stopped = set(result.stopped)
            for first, i in drafts:
                row = plan.rows[i]
                rows = logits[first : first + row.num_tokens]
                try:
                    kept, token, done = self.sampler.verify(rows, row.request, row.draft)
                except Exception as exc:  # one bad row must not sink the batch
                    result.errors[row.request.slot] = f"sampling failed: {exc}"
                    continue
                result.sampled[row.request.slot] = token
                accepted[row.request.slot] = kept
                if done:
                    stopped.add(row.request.slot)
            return result._replace(accepted=accepted, stopped=frozenset(stopped))
