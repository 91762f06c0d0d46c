"""Teacher-forced scoring of one token sequence through a runner's paged KV cache: at every
position, the log-probability of the token that actually follows and the model's own top
choice, computed as the engine computes a prompt (K/V written in the runner's `kv_dtype`,
chunks attending to the cache). The 8-bit KV cache's quality checks compare these between
the two cache formats (tests/test_kv_int8.py, bench/kv_quality.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from lucedesk.engine.runner import PagedAttention, TorchSeqEngine
from lucedesk.errors import ConfigError
from lucedesk.kernels.metadata import AttentionMetadata

LOGIT_ROWS = 128  # logits rows computed at once (a 262k vocabulary: 134 MB in float32)


class Scores(NamedTuple):
    logprobs: torch.Tensor  # [n - 1] float32: log p(tokens[i + 1] | tokens[: i + 1])
    top1: torch.Tensor  # [n - 1] int64: the most likely next token at position i


def score_tokens(runner: TorchSeqEngine, token_ids: list[int], chunk: int = 512) -> Scores:
    """Runs `token_ids` as one sequence in prompt chunks of `chunk` tokens over blocks
    0.. of the runner's cache (which it overwrites: use a runner no engine is stepping)."""
    n, block_size = len(token_ids), runner.block_size
    table = list(range(-(-n // block_size)))
    if len(table) > runner.num_blocks:
        raise ConfigError(
            f"{n} tokens need {len(table)} KV blocks, the runner has {runner.num_blocks}"
        )
    device = runner.device
    ids = torch.tensor(token_ids, device=device)
    logprobs, top1 = [], []
    with torch.inference_mode():
        for start in range(0, n - 1, chunk):
            end = min(n, start + chunk)
            meta = AttentionMetadata.build([end - start], [end], [table], block_size, 0, device)
            attention = PagedAttention(runner.kernels, runner.caches, meta, runner.scale)
            positions = torch.arange(start, end, device=device)
            hidden = runner.model(ids[start:end], positions, attention)  # [rows, H]
            targets = ids[start + 1 : end + 1]  # row i predicts the token after it
            for r in range(0, targets.shape[0], LOGIT_ROWS):
                rows = runner.model.compute_logits(hidden[r : r + LOGIT_ROWS]).log_softmax(-1)
                want = targets[r : r + LOGIT_ROWS]
                logprobs.append(rows[: want.shape[0]].gather(1, want[:, None])[:, 0])
                top1.append(rows[: want.shape[0]].argmax(-1))
    return Scores(torch.cat(logprobs).cpu(), torch.cat(top1).cpu())
