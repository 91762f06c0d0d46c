"""Hardware profiles: TOML files of engine settings, validated, detected and overridable.

Built-in profiles ship in the package (`lucedesk/profiles/*.toml`); a user's own go in
`<config dir>/lucedesk/profiles/*.toml` and replace a built-in of the same name.
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from lucedesk.config import EngineConfig
from lucedesk.errors import ConfigError

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).parent / "profiles"
BACKENDS = ("cpu", "cuda", "rocm", "gpu")  # gpu = any of cuda/rocm
_TOP_KEYS = {"description", "match", "engine"}
_MATCH_KEYS = {"backend": str, "gfx_arch": list, "device_name": list}
# Detection order: the most specific first, then any GPU, then the CPU.
_DETECT_ORDER = ("r9700", "strix-halo", "cuda", "cpu")


@dataclass(slots=True, frozen=True)
class DeviceInfo:
    """What detection looks at; read from torch by `probe_device`, faked in tests."""

    backend: str  # "cpu" | "cuda" | "rocm"
    name: str = ""
    gfx_arch: str = ""
    total_memory: int = 0


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    path: Path
    description: str
    backend: str
    gfx_arch: tuple[str, ...]
    device_name: tuple[str, ...]
    engine: EngineConfig
    builtin: bool

    def matches(self, dev: DeviceInfo) -> bool:
        if self.backend == "gpu":
            return dev.backend in ("cuda", "rocm")
        if self.backend != dev.backend:
            return False
        if self.gfx_arch or self.device_name:
            arch = dev.gfx_arch.split(":")[0]  # "gfx1201:sramecc-:xnack-" -> "gfx1201"
            return arch in self.gfx_arch or any(
                n.lower() in dev.name.lower() for n in self.device_name
            )
        return True


def user_profile_dir() -> Path:
    return Path(platformdirs.user_config_dir("lucedesk")) / "profiles"


def probe_device() -> DeviceInfo:
    import torch

    if not torch.cuda.is_available():
        return DeviceInfo("cpu")
    props = torch.cuda.get_device_properties(0)
    backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return DeviceInfo(
        backend, props.name, getattr(props, "gcnArchName", "") or "", int(props.total_memory)
    )


def _coerce(key: str, value: object, field_type: type, source: str) -> object:
    if field_type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if field_type is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false (got {value!r})")
    if field_type is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{source}: {key} must be an integer (got {value!r})")
    if field_type is str and not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a string (got {value!r})")
    if field_type is float and not isinstance(value, float):
        raise ConfigError(f"{source}: {key} must be a number (got {value!r})")
    return value


_FIELD_TYPES = {f.name: type(f.default) for f in dataclasses.fields(EngineConfig)}


def engine_config_from(values: dict, source: str, base: EngineConfig | None = None) -> EngineConfig:
    """Validate a table of engine settings (unknown keys, types, ranges) into an EngineConfig."""
    changes = {}
    for key, value in values.items():
        if key not in _FIELD_TYPES:
            allowed = ", ".join(sorted(_FIELD_TYPES))
            raise ConfigError(f"{source}: unknown setting {key!r} (allowed: {allowed})")
        changes[key] = _coerce(key, value, _FIELD_TYPES[key], source)
    return dataclasses.replace(base or EngineConfig(), **changes).validate(source)


def load_profile(path: Path, builtin: bool = False) -> Profile:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {sorted(unknown)[0]!r} (allowed: {', '.join(sorted(_TOP_KEYS))})"
        )
    match = data.get("match", {})
    engine = data.get("engine", {})
    if not isinstance(match, dict) or not isinstance(engine, dict):
        raise ConfigError(f"{path}: [match] and [engine] must be tables")
    for key, value in match.items():
        if key not in _MATCH_KEYS:
            raise ConfigError(
                f"{path}: unknown key {key!r} in [match] (allowed: {', '.join(_MATCH_KEYS)})"
            )
        kind = _MATCH_KEYS[key]
        if not isinstance(value, kind) or (
            kind is list and not all(isinstance(v, str) for v in value)
        ):
            what = "a list of strings" if kind is list else "a string"
            raise ConfigError(f"{path}: [match] {key} must be {what} (got {value!r})")
    backend = match.get("backend", "cpu")
    if backend not in BACKENDS:
        raise ConfigError(
            f"{path}: [match] backend must be one of {', '.join(BACKENDS)} (got {backend!r})"
        )
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{path}: description must be a string")
    return Profile(
        name=path.stem,
        path=path,
        description=description,
        backend=backend,
        gfx_arch=tuple(match.get("gfx_arch", ())),
        device_name=tuple(match.get("device_name", ())),
        engine=engine_config_from(engine, f"{path} [engine]"),
        builtin=builtin,
    )


def all_profiles(user_dir: Path | None = None) -> dict[str, Profile]:
    """Built-ins, then the user's own (same name replaces the built-in)."""
    found = {p.stem: load_profile(p, builtin=True) for p in sorted(BUILTIN_DIR.glob("*.toml"))}
    user_dir = user_profile_dir() if user_dir is None else user_dir
    if user_dir.is_dir():
        for p in sorted(user_dir.glob("*.toml")):
            found[p.stem] = load_profile(p)
    return found


def detect(profiles: dict[str, Profile], device: DeviceInfo) -> tuple[Profile, str]:
    """The profile for this machine and a sentence saying why."""
    order = [n for n in _DETECT_ORDER if n in profiles]
    order += [n for n in profiles if n not in order]
    # Profiles naming an arch or a device are tried before catch-alls of the same backend.
    order.sort(key=lambda n: not (profiles[n].gfx_arch or profiles[n].device_name))
    for name in order:
        if profiles[name].matches(device):
            what = device.name or device.backend
            if device.gfx_arch:
                what += f" ({device.gfx_arch})"
            return profiles[name], f"profile {name!r} matches {device.backend} device {what}"
    if "cpu" in profiles:
        return profiles["cpu"], f"no profile matches {device.backend} {device.name!r}; using 'cpu'"
    raise ConfigError("no profile matches this machine and no 'cpu' profile exists")


def parse_overrides(items: list[str], base: EngineConfig) -> EngineConfig:
    """`--set key=value` strings applied on top of a profile's settings."""
    values: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        kind = _FIELD_TYPES.get(key)
        if kind is None:
            raise ConfigError(
                f"--set: unknown setting {key!r} (allowed: {', '.join(sorted(_FIELD_TYPES))})"
            )
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError(raw)
                values[key] = raw.lower() in ("true", "1", "yes", "on")
            else:
                values[key] = kind(raw)
        except ValueError:
            raise ConfigError(f"--set {key}: {raw!r} is not a valid {kind.__name__}") from None
    return engine_config_from(values, "--set", base)


def resolve(
    profile: str | None,
    overrides: list[str] | None = None,
    device: DeviceInfo | None = None,
    user_dir: Path | None = None,
) -> tuple[Profile, EngineConfig, str]:
    """The profile to use (a name, a .toml path, or detected) and its settings with the
    command line's overrides applied."""
    if profile and (profile.endswith(".toml") or "/" in profile):
        chosen, why = load_profile(Path(profile).expanduser()), f"profile file {profile}"
    else:
        profiles = all_profiles(user_dir)
        if profile:
            if profile not in profiles:
                raise ConfigError(f"unknown profile {profile!r} (available: {', '.join(profiles)})")
            chosen, why = profiles[profile], f"profile {profile!r} chosen on the command line"
        else:
            chosen, why = detect(profiles, device or probe_device())
    config = parse_overrides(list(overrides or []), chosen.engine)
    log.info(why)
    return chosen, config, why
