"""TorchSeqEngine: runs a StepPlan as one ragged forward over the paged KV cache."""

from __future__ import annotations

import torch

from lucedesk.engine.models.llama import LlamaModel
from lucedesk.engine.sampler import Sampler
from lucedesk.engine.scheduler import StepPlan
from lucedesk.engine.seq_engine import StepResult
from lucedesk.kernels import Kernels, get_kernels
from lucedesk.kernels.metadata import AttentionMetadata


class PagedAttention:
    """The attention object the model calls per layer for one step: writes the new K/V rows
    into their blocks, then attends over each sequence's blocks."""

    def __init__(
        self,
        kernels: Kernels,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        self.kernels = kernels
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.meta = meta
        self.scale = scale

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer_idx], self.v_caches[layer_idx]
        self.kernels.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return self.kernels.attention(q, k_cache, v_cache, self.meta, self.scale)


class TorchSeqEngine:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        kernels: str = "torch",
        device: torch.device | str = "cpu",
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
        self.k_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in model.layers]
        self.v_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in model.layers]
        self.scale = c.head_dim**-0.5
        self.sampler = Sampler()

    def forget(self, request_ids: list[str]) -> None:
        self.sampler.forget(request_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        rows = plan.rows
        input_ids: list[int] = []
        positions: list[int] = []
        for row in rows:
            input_ids.extend(row.request.token_ids(row.start, row.start + row.num_tokens))
            positions.extend(range(row.start, row.start + row.num_tokens))
        meta = AttentionMetadata.build(
            query_lens=[r.num_tokens for r in rows],
            seq_lens=[r.start + r.num_tokens for r in rows],
            block_tables=[r.request.block_ids for r in rows],
            block_size=self.block_size,
            num_decodes=len(plan.decodes),
            device=self.device,
        )
        attention = PagedAttention(self.kernels, self.k_caches, self.v_caches, meta, self.scale)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                attention,
            )  # [num_tokens, H]
            # The LM head runs only on decode rows and on the last row of finishing chunks.
            sampling = [i for i, r in enumerate(rows) if r.sample]
            last_rows = [meta.query_start_cpu[i + 1] - 1 for i in sampling]
            if not sampling:
                return StepResult({}, {})
            logits = self.model.compute_logits(hidden[last_rows])  # [R, vocab]
            return self.sampler.sample(logits, [rows[i].request for i in sampling])
