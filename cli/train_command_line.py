"""The command line of ``python train.py`` / ``draftsmith train`` before Hydra runs: the
``target=PATH`` / ``data=PATH`` shorthands, ``--help`` (the recipes, or one recipe's keys), and the
checks that turn a config that does not compose, a key the recipe's schema lacks or a value out of
range (in any job of a sweep) into one ``error:`` line before Hydra makes a run folder.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# `target=PATH` / `data=PATH` shorthands: a value that is not an option of the group is a model
# folder / data spec.
SHORTHANDS = {"target": "target.name_or_path", "data": "data.spec"}


def expand_shorthands(argv: list[str]) -> list[str]:
    """Rewrite ``target=/models/x`` to ``target.name_or_path=/models/x`` and ``data=chats.jsonl`` to
    ``data.spec=chats.jsonl`` unless the value names a config of that group (``target=smollm2``
    stays a group choice).
    """
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in SHORTHANDS and value and not (CONF_DIR / key / f"{value}.yaml").is_file():
            arg = f"{SHORTHANDS[key]}={value}"
        out.append(arg)
    return out


def check_launcher(argv: list[str]) -> str | None:
    """The error to print when ``hydra/launcher=slurm`` is asked for without hydra-submitit-launcher
    installed (Hydra's own message would be a missing config deep in a traceback), else None."""
    import importlib.util

    wants = any(
        a.split("=", 1)[0] in ("hydra/launcher", "+hydra/launcher")
        and "=" in a
        and a.split("=", 1)[1].startswith(("slurm", "submitit"))
        for a in argv
    )
    if wants and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return (
            "hydra/launcher=slurm needs the submitit launcher: pip install hydra-submitit-launcher "
            "(or `pip install draftsmith[slurm]`), then submit again"
        )
    return None


def recipe_names() -> list[str]:
    """Every registered recipe (draftsmith.recipes); a YAML file under conf/recipe/ alone is not
    one."""
    from draftsmith.recipes import recipe_names as registered

    return registered()


def chosen_recipe(overrides: list[str]) -> str | None:
    """The value of ``recipe=NAME`` on the command line, or None."""
    return next(
        (a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0].lstrip("+") == "recipe"), None
    )


def plain_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a run or a sweep (``--cfg job``, ``--resolve``, ``-m`` dropped); None for
    another Hydra flag, which Hydra handles itself."""
    out, skip = [], False
    for arg in argv:
        if skip or arg in ("--resolve", "-m", "--multirun"):
            skip = False
            continue
        if arg in ("--cfg", "-c"):
            skip = True
        elif arg.startswith("-"):
            return None
        else:
            out.append(arg)
    return out


def sweep_jobs(overrides: list[str]) -> list[list[str]] | None:
    """The override lists that check a sweep: every value of ``key=a,b`` once, the other keys at
    their first value (one list for a single run); None for a sweep Hydra expands itself
    (``range(...)``, quotes)."""
    keys, choices = [], []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        whole = value[:1] in ("[", "{") and value[-1:] in (
            "]",
            "}",
        )  # a list or dict value, not a sweep
        if "," in value and not whole and any(c in value for c in "()[]{}'\""):
            return None
        keys.append(f"{key}{sep}")
        choices.append([value] if whole or not sep else value.split(","))
    first = [k + c[0] for k, c in zip(keys, choices)]
    return [first] + [
        first[:i] + [keys[i] + v] + first[i + 1 :] for i, c in enumerate(choices) for v in c[1:]
    ]


def compose_overrides(overrides: list[str]) -> DictConfig:
    """Compose conf/train.yaml with ``overrides`` outside a Hydra app (the schemas are stored at
    import)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def composition_message(err: BaseException, overrides: list[str]) -> str:
    """One line for a config that does not compose: no or an unknown recipe, a key the recipe's
    schema lacks (with the close match), a value of the wrong type; Hydra's own message flattened
    otherwise."""
    import re

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    from draftsmith.distill.config.checks import unknown_key_message
    from draftsmith.recipes import RECIPES

    recipe, text, cause = chosen_recipe(overrides), str(err), err.__cause__
    if "You must specify 'recipe'" in text:
        return (
            f"no recipe: pick one with recipe=NAME ({', '.join(recipe_names())}); python train.py"
            " --help says more"
        )
    missing = re.search(r"Could not find '(recipe|schema)/([^']*)'", text)
    if missing and missing.group(2) not in RECIPES:
        return f"unknown recipe {missing.group(2)!r}; valid recipes: {', '.join(recipe_names())}"
    if missing:  # registered, but conf/recipe/<name>.yaml is gone
        return (
            f"recipe {missing.group(2)!r} has no config: conf/recipe/{missing.group(2)}.yaml is"
            " missing"
        )
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key and recipe in RECIPES:
        return unknown_key_message(str(full_key), recipe, RECIPES[recipe].schema)
    if isinstance(cause, ValidationError) and full_key:
        given = next(
            (a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0].lstrip("+") == full_key),
            "",
        )
        return f"{full_key}={given}: {str(cause).splitlines()[0]}"
    detail = f" ({str(cause).splitlines()[0]})" if cause is not None and str(cause) else ""
    return " ".join(text.split()) + detail


def preflight(argv: list[str]) -> str | None:
    """The one-line error for a command line whose config does not compose, names a key its recipe's
    schema lacks or a value outside its declared range (for a sweep, in any of its jobs); None when
    it is fine.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from draftsmith.distill.config.checks import (
        repeated_override,
        schema_problems,
        target_folder_problem,
    )

    overrides = plain_overrides(argv)
    if overrides is not None and (repeated := repeated_override(overrides)) is not None:
        return repeated
    jobs = sweep_jobs(overrides) if overrides is not None else None
    for job in jobs or []:
        try:
            cfg = compose_overrides(job)
        except (HydraException, OmegaConfBaseException) as err:
            return composition_message(err, job)
        if problems := schema_problems(cfg):
            return "; ".join(problems)
        if (problem := target_folder_problem(str(cfg.target.name_or_path))) is not None:
            return problem
    return None


def help_text(argv: list[str], prog: str) -> str:
    """``--help``: the usage and the recipes; with ``recipe=NAME``, that recipe's keys (type,
    default, doc, range)."""
    from draftsmith.distill.config.checks import describe_keys

    head = prog if not prog.endswith(".py") else f"python {Path(prog).name}"
    overrides = [a for a in plain_overrides([a for a in argv if a not in ("--help", "-h")]) or []]
    recipe = chosen_recipe(overrides)
    if recipe is not None:
        if (problem := preflight(overrides)) is not None:
            return f"error: {problem}"
        lines = describe_keys(compose_overrides(overrides))
        return "\n".join(
            [
                (
                    f"{head} recipe={recipe}: keys (set any with key=value; values shown with these"
                    " overrides applied)"
                ),
                *lines,
            ]
        )
    presets = {
        g: ", ".join(sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml")))
        for g in ("trainer", "logger")
    }
    return "\n".join(
        [
            f"usage: {head} recipe=NAME [key=value ...]",
            "",
            (
                "Trains a drafter (or controller) against a frozen target and exports it into the"
                " run folder"
            ),
            (
                "(outputs/<recipe>/<overrides>; re-running the same command there resumes from its"
                " last checkpoint)."
            ),
            "",
            f"recipes: {', '.join(recipe_names())}",
            "",
            (
                f"  {head} recipe=NAME --help   list NAME's keys: type, default, meaning and"
                " allowed range"
            ),
            (
                "  target=PATH  data=PATH     the target model folder and the chat data"
                " (target.name_or_path, data.spec)"
            ),
            f"  trainer=PRESET             {presets['trainer']}",
            f"  logger=KIND                {presets['logger']}",
            (
                "  hydra.run.dir=DIR          the run folder; run.resume=false starts over in an"
                " existing one"
            ),
            (
                "  --cfg job                  print the composed config and exit; -m KEY=a,b runs a"
                " sweep"
            ),
        ]
    )
