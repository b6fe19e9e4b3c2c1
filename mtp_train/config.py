"""The run config: one typed dataclass per part, each in the light `config.py` of its stage (no torch), composed
here into `RunConfig`, which Hydra fills from a recipe under `recipes/` plus `key=value` overrides.

Every recipe starts with `defaults: [run_schema, _self_]`, so Hydra checks it against `RunConfig`:
a key that the schema does not know fails, in the recipe file and on the command line alike (and
`+key=` / `~key` overrides, which would add or drop keys, are refused).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from mtp_train.data.config import DataConfig
from mtp_train.export.config import ExportConfig
from mtp_train.inference.config import GenerateConfig
from mtp_train.model.cache import model_path
from mtp_train.model.config import DEFAULT_DEPTH, HeadConfig, InfoConfig, TargetConfig, override_literal
from mtp_train.store.config import StoreConfig
from mtp_train.train.config import TrainConfig
from mtp_train.validate.config import ValidateConfig

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"
# `recipes/` at the top of the repo; shipped inside the wheel as mtp_train/recipes (a link in a checkout).
RECIPES_DIR = PACKAGE_DIR / "recipes"
SCHEMA_NAME = "run_schema"
# The head and loss options the `smollm2-135m` recipe sets for its own head (its start from the target's weights, the
# fed-back norm, the LK loss, no feature term): the benchmarks and tests that compare head variants or match the
# peers' settings start from the plain head instead, with `PLAIN_HEAD`, these keys put back to the schema's default
# (harmless on recipes that do not set them; an eagle3 run adds `train.loss.w_feat=0` after them).
PLAIN_HEAD_KEYS = ("head.init_fc", "head.init_layer", "head.norm_output", "train.loss.accept_weight",
                   "train.loss.w_feat")


@dataclass
class RunConfig:
    recipe: str = MISSING  # set from the command line's recipe=...
    run_dir: str = MISSING  # every artifact of the run lives under it
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    info: InfoConfig = field(default_factory=InfoConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    resume: bool = False  # train: continue from run_dir/checkpoints/latest

    def __post_init__(self) -> None:
        if self.train.depth is None:  # the recipe left it to the head variant
            self.train.depth = DEFAULT_DEPTH.get(self.head.variant, 1)


class ConfigError(ValueError):
    """A recipe or override that cannot make a valid run config; the message says what and where."""


def default_overrides(*keys: str) -> list[str]:
    """`key=value` overrides that put each dotted key (`head.init_fc`, `train.loss.w_feat`) back to the schema's
    default, whatever a recipe set it to."""
    schema = OmegaConf.structured(RunConfig)
    out = []
    for key in keys:
        if OmegaConf.select(schema, key, default=MISSING) is MISSING:
            raise ConfigError(f"{key}: not a key of the run config")
        value = OmegaConf.select(schema, key)
        value = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
        out.append(f"{key}={override_literal(value)}")
    return out


def _asset(name: str) -> str:
    path = ASSETS_DIR / name
    if not path.exists():
        raise ConfigError(f"packaged asset {name!r} not found under {ASSETS_DIR}")
    return str(path)


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("models"):
        OmegaConf.register_new_resolver("models", model_path)


def available_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def _locate_recipe(recipe: str) -> tuple[Path, str]:
    """(config dir, config name) for a recipe given by name or as a path to a YAML file."""
    if recipe.endswith(".yml"):
        raise ConfigError(f"recipe {recipe!r}: recipe files must end in .yaml")
    if recipe.endswith(".yaml") or os.sep in recipe:
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        return path.parent, path.stem
    if not (RECIPES_DIR / f"{recipe}.yaml").is_file():
        names = available_recipes()
        close = difflib.get_close_matches(recipe, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown recipe {recipe!r}: no {recipe}.yaml in {RECIPES_DIR}.{hint} "
                          f"Available: {', '.join(names)}")
    return RECIPES_DIR, recipe


def _known_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items() if isinstance(node, dict) else []:
        full = f"{prefix}{k}"
        keys.append(full)
        keys += _known_keys(v, full + ".")
    return keys


@functools.cache
def _schema_keys() -> list[str]:
    return _known_keys(OmegaConf.to_container(OmegaConf.structured(RunConfig)))


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _unknown_key_message(key: str, where: str) -> str:
    close = difflib.get_close_matches(key, _schema_keys(), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [k for k in _schema_keys() if k.rsplit(".", 1)[0] == parent and k.count(".") == key.count(".")] \
        if parent else [k for k in _schema_keys() if "." not in k]
    return (f"unknown config key {key!r} ({where}).{hint} "
            f"Keys {'under ' + repr(parent) if parent else 'at the top level'}: {', '.join(siblings)}")


def _explain(exc: BaseException, recipe: str, recipe_file: Path) -> str:
    """Turn Hydra's and OmegaConf's errors into one line that names the key and where it came from."""
    chain = _exception_chain(exc)
    text = "\n".join(str(e) for e in chain)
    override = re.search(r"Could not override '([^']+)'", text)
    inner = next((e for e in chain if isinstance(e, ConfigKeyError) and dataclasses.is_dataclass(
        getattr(e, "object_type", None))), None)
    if override and inner is not None and inner.key not in override.group(1).split("."):
        # a bad key inside a structured value, e.g. one data source
        known = ", ".join(f.name for f in dataclasses.fields(inner.object_type))
        return (f"unknown key {inner.key!r} in the value of {override.group(1)!r} (from the command line); "
                f"{inner.object_type.__name__} has: {known}")
    if override and re.search(r"not in struct|To append to your config", text):
        return _unknown_key_message(override.group(1), "from the command line")
    ambiguous = re.search(r"Ambiguous value for argument '([^'=]+)=", text)
    if ambiguous:
        return (f"the value of {ambiguous.group(1)!r} has a comma: quote it inside the shell's quotes "
                "(\"key='a,b'\") or write a list (key=[a,b])")
    unparsable = next((e for e in chain if type(e).__name__ == "OverrideParseException"), None)
    if unparsable is not None:
        return (f"cannot parse the override {getattr(unparsable, 'override', '')!r} "
                f"({str(unparsable).splitlines()[0]}): quote the value inside the shell's quotes, \"key='my value'\"")
    omega = next((e for e in chain if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None)), None)
    if isinstance(omega, ConfigKeyError):
        return _unknown_key_message(str(omega.full_key), f"in recipe file {recipe_file}")
    if isinstance(omega, ValidationError):
        return f"bad value for {omega.full_key!r} (recipe {recipe}): {str(omega).splitlines()[0]}"
    message = next((str(e).strip() for e in chain if str(e).strip() not in ("", "None")), type(exc).__name__)
    return f"recipe {recipe!r} ({recipe_file}) does not compose: {message}"


def _hydra_compose(config_dir: Path, name: str, overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return hydra_compose(config_name=name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def compose(recipe: str, overrides: list[str] = ()) -> RunConfig:
    """Compose `recipes/<recipe>.yaml` (or a YAML file by path) with `key=value` overrides into a typed,
    fully resolved `RunConfig`; `run_dir` defaults to `runs/<recipe name>`. Raises ConfigError with a
    message that names the key at fault."""
    _register()
    config_dir, name = _locate_recipe(recipe)
    recipe_file = config_dir / f"{name}.yaml"
    overrides = [o for o in overrides if not o.startswith("recipe=")]
    for o in overrides:
        if o.startswith(("+", "~")):
            raise ConfigError(f"bad argument {o!r}: keys cannot be added or removed, every key is in the typed "
                              "schema (see the keys with --cfg)")
        if "=" not in o or o.startswith("="):
            raise ConfigError(f"bad argument {o!r}: expected key=value (e.g. run_dir=runs/demo)")
    if not any(o.startswith("run_dir=") for o in overrides):
        overrides.append(f"run_dir=runs/{name}")
    try:
        cfg = _hydra_compose(config_dir, name, overrides)
    except Exception as e:  # Hydra wraps OmegaConf's errors in its own
        error = e
    else:
        error = None
    # Without the schema in its defaults list a recipe is an untyped dict: say so rather than fail on a key.
    plain = cfg if error is None else _try_compose(config_dir, name)
    if plain is not None and OmegaConf.get_type(plain) is not RunConfig:
        raise ConfigError(f"recipe file {recipe_file} is not built on the schema: start it with "
                          "`defaults: [run_schema, _self_]` (see recipes/tiny.yaml)")
    if error is not None:
        raise ConfigError(_explain(error, recipe, recipe_file)) from error
    cfg.recipe = recipe
    return to_run_config(cfg, recipe)


def _try_compose(config_dir: Path, name: str) -> DictConfig | None:
    try:
        return _hydra_compose(config_dir, name, [])
    except Exception:
        return None


def to_run_config(cfg: DictConfig, recipe: str) -> RunConfig:
    missing = sorted(k for k in _schema_keys() if _is_missing(cfg, k))
    if missing:
        hints = {"run_dir": "run_dir=runs/NAME", "target.path": "target.path=/path/to/hf/checkpoint"}
        needed = ", ".join(hints.get(k, f"{k}=...") for k in missing)
        raise ConfigError(f"recipe {recipe!r} needs {', '.join(repr(k) for k in missing)}: pass {needed}")
    try:
        OmegaConf.resolve(cfg)
        return OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError) as e:
        ours = [c for c in _exception_chain(e) if isinstance(c, ValueError) and not isinstance(c, OmegaConfBaseException)]
        cause = ours[0] if ours else e
        where = _failing_list_entry(cfg)  # a typed list entry's own check does not know its place
        raise ConfigError(f"recipe {recipe!r}: {where + ': ' if where else ''}{str(cause).splitlines()[0]}") from e


def _failing_list_entry(node, path: str = "") -> str | None:
    """The key of the first entry of a list of typed configs (e.g. `validate.trees[1]`) that fails on its own."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            found = _failing_list_entry(node._get_node(key), f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            if isinstance(item, DictConfig) and OmegaConf.get_type(item) not in (dict, None):
                try:
                    OmegaConf.to_object(item)
                except (OmegaConfBaseException, ValueError):
                    return f"{path}[{i}]"
    return None


def _is_missing(cfg: DictConfig, key: str) -> bool:
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.get(p) if isinstance(node, DictConfig) else None
        if node is None:
            return False
    return isinstance(node, DictConfig) and OmegaConf.is_missing(node, leaf)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_resolved(cfg: RunConfig, run_dir: Path) -> Path:
    """Write the resolved config to `run_dir/config.yaml`. A different config already there is kept, renamed
    `config.N.yaml`, so nothing written earlier is lost."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    text = to_yaml(cfg)
    if path.exists() and path.read_text() != text:
        n = 1
        while (run_dir / f"config.{n}.yaml").exists():
            n += 1
        path.rename(run_dir / f"config.{n}.yaml")
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def __getattr__(name: str):
    if name == "PLAIN_HEAD":  # built from the schema when asked for, so importing this module stays cheap
        return default_overrides(*PLAIN_HEAD_KEYS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
