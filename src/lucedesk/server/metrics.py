"""The engine's stats snapshot in Prometheus' text exposition format."""

from __future__ import annotations

from lucedesk.engine import EngineStats, HistogramSnapshot


def _metric(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")


def _histogram(lines: list[str], name: str, help_text: str, h: HistogramSnapshot | None) -> None:
    _metric(lines, name, "histogram", help_text)
    if h is None:
        return
    for bound, count in zip(h.buckets, h.counts):
        lines.append(f'{name}_bucket{{le="{bound:g}"}} {count}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
    lines.append(f"{name}_sum {h.total:.6f}")
    lines.append(f"{name}_count {h.count}")


def render(stats: EngineStats) -> str:
    lines: list[str] = []
    _metric(lines, "lucedesk_requests_total", "counter", "Finished requests by finish reason.")
    for reason in ("stop", "length", "cancelled", "error"):
        count = stats.finish_reasons.get(reason, 0)
        lines.append(f'lucedesk_requests_total{{finish_reason="{reason}"}} {count}')
    _metric(lines, "lucedesk_prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
    lines.append(f"lucedesk_prompt_tokens_total {stats.prompt_tokens_total}")
    _metric(lines, "lucedesk_generation_tokens_total", "counter", "Generated tokens.")
    lines.append(f"lucedesk_generation_tokens_total {stats.generation_tokens_total}")
    _histogram(lines, "lucedesk_time_to_first_token_seconds", "Time to first token.", stats.ttft)
    _histogram(lines, "lucedesk_inter_token_latency_seconds", "Time between tokens.", stats.itl)
    gauges = [
        ("lucedesk_kv_blocks_used", "KV cache blocks in use.", stats.blocks_used),
        ("lucedesk_kv_blocks_total", "KV cache blocks in the pool.", stats.blocks_total),
        (
            "lucedesk_kv_blocks_touched",
            "KV cache blocks ever used: the pool's resident part (it is reserved, not written).",
            stats.blocks_touched,
        ),
        ("lucedesk_kv_block_bytes", "Bytes of one KV block, all layers.", stats.kv_block_bytes),
        ("lucedesk_requests_running", "Requests holding a slot.", stats.num_running),
        ("lucedesk_requests_waiting", "Requests in the queue.", stats.num_waiting),
        ("lucedesk_generation_tokens_per_second", "Recent output rate.", stats.tokens_per_s),
    ]
    for name, help_text, value in gauges:
        _metric(lines, name, "gauge", help_text)
        lines.append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
    _metric(lines, "lucedesk_preemptions_total", "counter", "Requests preempted for KV space.")
    lines.append(f"lucedesk_preemptions_total {stats.num_preemptions}")
    _metric(
        lines,
        "lucedesk_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    )
    lines.append(f"lucedesk_prefix_cache_hit_tokens_total {stats.prefix_cache_hit_tokens}")
    _metric(
        lines,
        "lucedesk_prefix_disk_hit_tokens_total",
        "counter",
        "Prompt tokens of those read back from the prefix cache on disk.",
    )
    lines.append(f"lucedesk_prefix_disk_hit_tokens_total {stats.prefix_disk_hit_tokens}")
    _metric(
        lines,
        "lucedesk_prefix_cache_query_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    )
    lines.append(f"lucedesk_prefix_cache_query_tokens_total {stats.prefix_cache_queries}")
    counters = [
        (
            "lucedesk_draft_rows_total",
            "Decode rows that carried a prompt-lookup draft.",
            stats.draft_rows,
        ),
        ("lucedesk_draft_tokens_total", "Prompt-lookup draft tokens verified.", stats.draft_tokens),
        (
            "lucedesk_draft_accepted_tokens_total",
            "Draft tokens the model agreed with.",
            stats.accepted_tokens,
        ),
    ]
    for name, help_text, value in counters:
        _metric(lines, name, "counter", help_text)
        lines.append(f"{name} {value}")
    return "\n".join(lines) + "\n"
