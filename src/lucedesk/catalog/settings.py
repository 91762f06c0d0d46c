"""Settings a person keeps per model, in `models.toml` in lucedesk's config folder, by the
name `lucedesk models` lists (or a file's path):

    ["qwen3:30b"]
    chat_template = "~/templates/qwen3.jinja"   # used instead of the file's own template

`--chat-template FILE` on the command line takes precedence."""

from __future__ import annotations

import tomllib
from pathlib import Path

import platformdirs

from lucedesk.errors import ConfigError

KEYS = ("chat_template",)


def settings_path() -> Path:
    return Path(platformdirs.user_config_dir("lucedesk")) / "models.toml"


def model_settings(name: str, path: Path | None = None) -> dict:
    """The settings of the model called `name` (or lying at `path`); {} where none."""
    where = path or settings_path()
    if not where.is_file():
        return {}
    try:
        table = tomllib.loads(where.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    entry = table.get(name, {})
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: [{name!r}] must be a table of settings")
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: [{name!r}] {unknown[0]}: unknown (allowed: {', '.join(KEYS)})")
    return entry


def chat_template(name: str | None, given: str | None, path: Path | None = None) -> str | None:
    """The chat template to use instead of the model's own: the file `given` on the command
    line, else the model's `chat_template` setting, else None (the model's own)."""
    where = "--chat-template"
    file = given
    if file is None and name is not None:
        file = model_settings(name, path).get("chat_template")
        where = f"{path or settings_path()}: [{name!r}] chat_template"
    if file is None:
        return None
    if not isinstance(file, str):
        raise ConfigError(f"{where} must be a file's path")
    target = Path(file).expanduser()
    try:
        text = target.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} {target}: cannot be read ({exc})") from None
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{target}: line {exc.lineno}: {exc.message}") from None
    return text
