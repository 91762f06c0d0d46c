"""Every model on this machine with its summary (architecture, parameters, quant, size,
context) and whether it fits: what `lucedesk models` prints and the TUI's picker shows.
Summaries are read from the files' headers once and kept in the cache, keyed by each
file's path, size and modification time."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from lucedesk.catalog.stores import LocalModel, local_models
from lucedesk.catalog.summary import ModelSummary, summarize_path
from lucedesk.errors import LucedeskError

SUMMARY_CACHE_VERSION = 4  # 4: matmul values by type and the MLP type (held_formats)


@dataclass(slots=True, frozen=True)
class ListedModel:
    name: str
    path: Path
    source: str
    summary: ModelSummary | None
    problem: str | None  # why it cannot run here: no summary, its kind, its size
    fits: bool | None  # None: not known (no summary, or no judge asked)

    def as_dict(self) -> dict:
        s = self.summary
        return {
            "name": self.name,
            "path": str(self.path),
            "source": self.source,
            "family": s.architecture if s else None,
            "parameters": s.params if s else None,
            "quant": s.quant if s else None,
            "size_bytes": s.size_bytes if s else None,
            "context": s.context if s else None,
            "fits": self.fits,
            "problem": self.problem,
        }


def summary_cache_path() -> Path:
    return Path(platformdirs.user_cache_dir("lucedesk")) / "model-summaries.json"


class SummaryCache:
    """Summaries by file, valid while the file's size and modification time hold."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or summary_cache_path()
        try:
            data = json.loads(self.path.read_text())
            entries = data["entries"] if data.get("version") == SUMMARY_CACHE_VERSION else {}
        except (OSError, ValueError, KeyError, AttributeError):
            entries = {}
        self.entries: dict[str, dict] = entries if isinstance(entries, dict) else {}
        self.changed = False

    @staticmethod
    def _stamp(path: Path) -> list[int]:
        target = path / "config.json" if path.is_dir() else path
        stat = target.stat()
        return [stat.st_size, stat.st_mtime_ns]

    def summary(self, path: Path) -> ModelSummary:
        key = str(path)
        stamp = self._stamp(path)
        entry = self.entries.get(key)
        if entry is not None and entry.get("stamp") == stamp:
            try:
                return ModelSummary.from_dict(entry["summary"])
            except (KeyError, TypeError):
                pass
        summary = summarize_path(path)
        self.entries[key] = {"stamp": stamp, "summary": summary.as_dict()}
        self.changed = True
        return summary

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": SUMMARY_CACHE_VERSION, "entries": self.entries}))
            tmp.replace(self.path)
        except OSError:  # a cache: a read-only home costs only the next listing's time
            pass


def list_models(
    judge: Callable[[ModelSummary], str | None] | None = None,
    models: list[LocalModel] | None = None,
) -> list[ListedModel]:
    """Every local model (or `models`), summarized; `judge` says why one cannot run here
    (None where it can: its family runs and it fits)."""
    cache = SummaryCache()
    listed = []
    for model in local_models() if models is None else models:
        fits = None
        try:
            summary, problem = cache.summary(model.path), None
        except (LucedeskError, OSError) as exc:
            summary, problem = None, str(exc)
        if judge is not None and summary is not None:
            problem = judge(summary)
            fits = problem is None
        listed.append(ListedModel(model.name, model.path, model.source, summary, problem, fits))
    cache.save()
    return listed
