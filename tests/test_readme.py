"""What README gives runs as written: each ``python bench/<script>.py`` flag is one its
parser takes, with a value it accepts; each ``python recipes/<recipe>.py`` override composes
into that recipe's Hydra config (both also wherever else a user reads a command: docs, the
configs, the scripts' and the package's docstrings and messages, a usage line's
``[optional]`` parts given and its placeholders left out); each ``python -m
lightning_hetermoe.<tool> <subcommand>`` named anywhere is one that tool has; each
``trainer.<name>=`` a user is told to type sets as written; the first
example trains; every import its Python shows imports. A renamed flag, field or name
otherwise leaves README pointing at nothing, which only a user finds."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
from helpers_bench import load_bench

ROOT = Path(__file__).resolve().parents[1]
# each Hydra recipe's config, as its @hydra.main names it (recipes/cli.py is LightningCLI's)
RECIPE_CONFIG = {path.stem: match.group(1) for path in sorted((ROOT / "recipes").glob("*.py"))
                 if (match := re.search(r'@hydra\.main\([^)]*config_name="(\w+)"', path.read_text()))}
COMMAND = re.compile(r"python (bench|recipes)/(\w+)\.py\b(.*)")


def code_spans(text: str) -> list[str]:
    """Every inline code span (one may break across lines) and every line of a fenced block."""
    spans, fenced = [], re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)  # fences indented in lists too
    for block in fenced.findall(text):
        spans += block.splitlines()[1:-1]
    spans += [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", fenced.sub("", text))]
    return spans


def readme_commands(path: Path = ROOT / "README.md") -> list[tuple[str, str, list[str]]]:
    """``(folder, script, arguments)`` of each command in a Markdown file's code (or each
    line of a script or config: their docstrings and comments), the shell's comments,
    continuations and chained commands taken off; a line that is code building a command
    (an f-string's ``{...}``, a quote left open) is no command a user types."""
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    found = []
    for span in code_spans(text) if path.suffix == ".md" else text.splitlines():
        for part in re.split(r"&&|;", span):
            match = COMMAND.search(part)
            rest = match.group(3).split("`")[0] if match else ""  # a docstring's code span ends there
            if match and not re.search(r"[{}]", rest):
                try:
                    words = shlex.split(rest, comments=True)
                except ValueError:
                    continue
                found.append((match.group(1), match.group(2), usage_words(words)))
    return found


def usage_words(words: list[str]) -> list[str]:
    """A usage line's words as a run of it: ``[optional]`` parts given (their brackets
    taken off; a Hydra list ``key=[a,b]`` keeps its own), ``...`` left out."""
    out, depth = [], 0
    for w in words:
        if w == "...":
            continue
        while w.startswith("["):  # (a Hydra list is a value: key=[...])
            w, depth = w[1:], depth + 1
        while depth and w.endswith("]") and w.count("]") > w.count("["):
            w, depth = w[:-1], depth - 1
        if w:
            out.append(w)
    return out


# README's, then every other place a user reads a command: docs, the configs, the recipes',
# benchmarks' and package's docstrings and messages
DOCUMENTS = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("conf/**/*.yaml")),
             *sorted(ROOT.glob("recipes/*.py")), *sorted(ROOT.glob("bench/*.py")),
             *sorted(ROOT.glob("lightning_hetermoe/**/*.py"))]
COMMANDS = readme_commands()
EVERYWHERE = [c for path in DOCUMENTS for c in readme_commands(path)]


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def bench_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``bench/<name>.py``'s main builds, caught as it parses (nothing runs).
    Its sibling modules import from ``bench/``, as when the script runs."""
    loaded = set(sys.modules)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    module = load_bench(name)

    def caught(self, *args, **kwargs):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Parser) as got:
        module.main()
    for sibling in set(sys.modules) - loaded:  # bench/ is off the path again: nor imported by name
        if Path(getattr(sys.modules[sibling], "__file__", None) or "/").parent == ROOT / "bench":
            del sys.modules[sibling]
    return got.value.parser


BENCH = sorted({(script, tuple(args)) for folder, script, args in EVERYWHERE if folder == "bench"})


@pytest.mark.parametrize("script,args", BENCH, ids=[" ".join((s, *a)) for s, a in BENCH])
def test_each_bench_command_parses(script, args, monkeypatch, capsys):
    assert (ROOT / "bench" / f"{script}.py").exists(), f"README runs bench/{script}.py, which is not there"
    parser = bench_parser(script, monkeypatch)
    monkeypatch.undo()
    for each in alternatives(args):
        try:
            parser.parse_args(each)
        except SystemExit:
            pytest.fail(f"python bench/{script}.py {' '.join(each)}: {capsys.readouterr().err.strip()}")


def alternatives(args: tuple[str, ...]) -> list[list[str]]:
    """A command whose value lists choices (``--strategy zebra|hetermoe``), once per choice."""
    runs = [[]]
    for a in args:
        choices = a.split("|") if re.fullmatch(r"[\w-]+(\|[\w-]+)+", a) else [a]
        runs = [r + [c] for r in runs for c in choices]
    return runs


def recipe_override_sets(args: tuple[str, ...]) -> list[list[str]]:
    """The overrides of one command, a multirun's sweeps (``a=x,y``) one set per value;
    placeholders (``<mix>``) and paths a user fills in are left out."""
    overrides = [a for a in args if "=" in a and "<" not in a and not a.startswith("hydra.")
                 and not re.fullmatch(r"[A-Z_|]+", a.split("=", 1)[1])]
    sets = [[]]
    for o in overrides:
        key, value = o.split("=", 1)
        values = value.split(",") if "-m" in args and "[" not in value else [value]
        sets = [s + [f"{key}={v}"] for s in sets for v in values]
    return sets


RECIPES = sorted({(script, tuple(args)) for folder, script, args in EVERYWHERE
                  if folder == "recipes" and script in RECIPE_CONFIG})


@pytest.mark.parametrize("script,args", RECIPES, ids=[" ".join((s, *a)) for s, a in RECIPES])
def test_each_recipe_command_composes(script, args):
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    assert (ROOT / "recipes" / f"{script}.py").exists(), f"README runs recipes/{script}.py, which is not there"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for overrides in recipe_override_sets(args):
            try:
                compose(RECIPE_CONFIG[script], overrides=overrides)
            except (HydraException, OmegaConfBaseException) as err:
                pytest.fail(f"python recipes/{script}.py {' '.join(overrides)}: {err}")


def test_a_stale_flag_or_field_is_caught(monkeypatch, capsys):
    """What the two tests above would say of a renamed flag and a renamed field."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    parser = bench_parser("plan_scale", monkeypatch)
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        parser.parse_args(["--routings", "skewed"])  # --routing
    assert "unrecognized arguments: --routings" in capsys.readouterr().err
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"), pytest.raises(HydraException):
        compose("config", overrides=["strategy.modes=zebra"])  # strategy.mode


def recipe_cli():
    """``recipes/cli.py`` as a module (it is a script, not a package's)."""
    import importlib.util

    pytest.importorskip("jsonargparse")
    spec = importlib.util.spec_from_file_location("recipe_cli", ROOT / "recipes" / "cli.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


CLI = sorted({tuple(args) for folder, script, args in EVERYWHERE if (folder, script) == ("recipes", "cli")})


@pytest.mark.parametrize("args", CLI, ids=[" ".join(a) for a in CLI])
def test_each_lightning_cli_command_parses(args, capsys):
    """LightningCLI parses the whole command and prints the config it would run."""
    cli = recipe_cli()
    with pytest.raises(SystemExit) as exit_:
        cli.main([*args, *(["--print_config"] if "--print_config" not in args else [])])
    out = capsys.readouterr()
    assert exit_.value.code in (0, None), f"python recipes/cli.py {' '.join(args)}: {out.err.strip()[-2000:]}"
    if "--trainer.strategy=hetermoe" in args:
        nested = any(a.startswith("--trainer.strategy.") for a in args)
        assert ("class_path: lightning_hetermoe.HeterMoEStrategy" if nested else "strategy: hetermoe") in out.out
    for a in args:
        if a.startswith("--trainer.strategy."):  # each strategy argument reached the strategy
            key, value = a.removeprefix("--trainer.strategy.").split("=", 1)
            assert f"      {key}: {value}" in out.out, a


def test_the_lightning_cli_names_a_config_refusal_in_one_line(capsys):
    """A field the pack refuses (``--model.model.d_model=30``) reaches LightningCLI wrapped in
    jsonargparse's own error under its traceback: the recipe exits with the pack's sentence."""
    cli = recipe_cli()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--trainer.accelerator=cpu", "--model.model.d_model=30"])
    assert str(exit_.value.code).startswith("[hetermoe] config error: model.d_model=30 is invalid: must be a positive "
                                            "multiple of n_heads=4"), exit_.value.code


@pytest.mark.parametrize("args, said", [
    (["--trainer.strategy=hetermoe", "--trainer.strategy.mode=zebar"], "strategy mode='zebar' is invalid"),
    (["--trainer.strategy", "hetermoe", "--trainer.strategy.mdoe", "zebra"], "did you mean mode"),
    (["--trainer.strategy=lightning_hetermoe.HeterMoEStrategy", "--trainer.strategy.num_microbatches=0"],
     "num_microbatches=0 is invalid"),
])
def test_the_lightning_cli_names_a_strategy_refusal_in_one_line(args, said):
    """A strategy argument the pack refuses: one line, not jsonargparse's usage and the Union
    subtypes it tried."""
    cli = recipe_cli()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--trainer.accelerator=cpu", *args])
    message = str(exit_.value.code)
    assert message.startswith("[hetermoe] config error: ") and said in message and "\n" not in message, message


def test_the_lightning_cli_leaves_another_strategy_s_arguments_to_it():
    cli = recipe_cli()
    args = ["fit", "--trainer.strategy=lightning.pytorch.strategies.FSDPStrategy",
            "--trainer.strategy.sharding_strategy=FULL_SHARD"]  # no argument of the pack's strategy
    assert cli.strategy_refusal(cli.with_strategy_class(args)) is None
    assert "sharding_strategy" in str(cli.strategy_refusal(cli.with_strategy_class(
        ["fit", "--trainer.strategy=hetermoe", *args[2:]])))


def test_readme_gives_commands_of_every_kind():
    kinds = {(folder, script in RECIPE_CONFIG or script) for folder, script, _ in COMMANDS if folder == "recipes"}
    assert {("recipes", True), ("recipes", "cli")} <= kinds and len(BENCH) > 20, (kinds, len(BENCH))


def module_commands() -> list[tuple[str, str]]:
    """``(module, subcommand)`` of each ``python -m lightning_hetermoe.<module> <subcommand>``
    that README, docs, the configs and the pack's own docstrings and messages name."""
    pattern = re.compile(r"python -m (lightning_hetermoe\.[\w.]+)[ \t]+([a-z][\w-]*)")
    return sorted({m.groups() for path in DOCUMENTS for m in pattern.finditer(path.read_text(encoding="utf-8"))})


MODULE_COMMANDS = module_commands()


@pytest.mark.parametrize("module,subcommand", MODULE_COMMANDS, ids=[" ".join(c) for c in MODULE_COMMANDS])
def test_each_module_command_named_anywhere_has_that_subcommand(module, subcommand, capsys):
    """A tool's subcommand moved to another module leaves every mention of the old place
    pointing at nothing (the Hugging Face export moved from ``ckpt`` to ``convert``; a
    comment and a config still named ``ckpt``)."""
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    with pytest.raises(SystemExit) as done:
        main([subcommand, "--help"])
    assert done.value.code == 0, capsys.readouterr().err


def told_trainer_settings() -> set[str]:
    """The ``trainer.<name>=`` settings a user is told to type on the main job's command line
    (not the Lightning CLI's ``--trainer.<name>=``)."""
    return {name for path in DOCUMENTS
            for name in re.findall(r"(?<![-+\w.])trainer\.([a-z_]+)=", path.read_text(encoding="utf-8"))}


def test_every_trainer_setting_the_docs_and_messages_name_is_set_as_they_write_it():
    """Set as written, without Hydra's ``+``: a key the trainer group does not list fails in
    Hydra (`Key 'accumulate_grad_batches' is not in struct`), as a plan in waves's own advice
    (`set trainer.accumulate_grad_batches=2`) once did."""
    from helpers_recipe import compose

    from lightning_hetermoe.run_config import read_run_config

    told = told_trainer_settings()
    assert {"accumulate_grad_batches", "max_steps", "accelerator", "precision"} <= told
    for name in sorted(told):
        value = {"accelerator": "cpu", "precision": "32-true"}.get(name, 2)
        kwargs = read_run_config(compose(f"trainer.{name}={value}")).trainer
        assert kwargs[name] == value, name


def test_the_module_commands_are_found():
    assert ("lightning_hetermoe.convert", "to-hf") in MODULE_COMMANDS
    assert ("lightning_hetermoe.ckpt", "consolidate") in MODULE_COMMANDS


def python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [textwrap.dedent(b) for b in re.findall(r"^[ \t]*```python\n(.*?)^[ \t]*```", text, re.S | re.M)]


def test_every_import_readme_shows_imports():
    lines = [line.split("#")[0].strip() for block in python_blocks() for line in block.splitlines()
             if re.match(r"(from \S+ )?import ", line.strip())]
    assert any("lightning_hetermoe" in line for line in lines), lines
    for line in lines:
        if "transformers" in line:
            pytest.importorskip("transformers")
        exec(line, {})  # a name README imports that the package no longer has raises here


@pytest.mark.slow
def test_readme_s_first_example_trains_as_written_and_exits_soon_after(tmp_path):
    """The front page's script, run as a user runs it (two CPU processes, auto mode), its
    50 steps cut to 3. It is also a user's script that just ends after ``fit`` (no
    ``strategy.shutdown()``, no ``destroy_process_group()``): every process of it is gone
    within seconds of its work (issue #38), with no abort and nothing leaked."""
    from helpers_exit import EXIT_S, run_to_exit

    first = python_blocks()[0]
    assert "max_steps=50" in first and first.rstrip().splitlines()[-1].startswith("trainer.fit(")
    script = tmp_path / "example.py"
    script.write_text(first.replace("max_steps=50", "max_steps=3"))
    marker = "`max_steps=3` reached"
    code, out, after_s = run_to_exit([sys.executable, str(script)], marker, cwd=tmp_path)
    assert code == 0, out[-3000:]
    assert "hetermoe[auto]: chose " in out, out[-3000:]
    assert "terminate called" not in out, out[-3000:]
    assert "leaked" not in out, out[-3000:]  # nanobind's report of objects finalization never freed
    assert after_s < EXIT_S, f"the script's processes ended {after_s:.1f} s after {marker!r}:\n{out[-2000:]}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_contents_list_every_section_and_each_link_lands_on_one():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    outside_code = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)
    headings = [h for h in re.findall(r"^#{2,3} (.+)$", outside_code, re.M) if h != "Contents"]
    contents = text.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert links == [github_anchor(h) for h in headings], "README's Contents and its headings differ"


def test_the_layout_names_every_module_of_the_folders_it_lists_file_by_file():
    """README's Layout lists the package's top level, ``strategy/`` and its backends file by
    file (``name.py``; a backend's folder as ``ep/ (name, name, ...)``), the other folders
    whole: a module added to one of the first is named there, or the list is wrong."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    block = layout[:layout.index("```", layout.index("```") + 3)]
    files = set(re.findall(r"([a-z_]+)\.py\b", block))
    inside = {folder: set(re.findall(r"[a-z_]+", names))
              for folder, names in re.findall(r"([a-z_]+)/ \(([^)]*)\)", block)}
    package = ROOT / "lightning_hetermoe"
    backends = package / "strategy" / "backends"

    def modules(folder: Path) -> set[str]:
        return {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}

    missing = {str(f.relative_to(ROOT)): sorted(modules(f) - files) for f in (package, package / "strategy", backends)}
    missing |= {str(f.relative_to(ROOT)): sorted(modules(f) - inside.get(f.name, set()))
                for f in backends.iterdir() if f.is_dir() and f.name != "__pycache__"}
    assert not any(missing.values()), f"README's Layout leaves out: {missing}"
    assert {"ep", "datacentric", "zebra"} <= set(inside)
