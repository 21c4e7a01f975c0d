"""The README and docs/ run as written: every shell command in their code blocks is run here, or listed below with the
reason; their links resolve; every built-in plugin has a README row and a page; the README's layout names every module.

Placeholders are filled from a fixture: `trl_ext.testing.write_demo`'s tiny model (`MODEL`, also `demo/model`), its
preference and prompt datasets (`PROMPTS`), a `recipe.yaml` that points at them (instead of the hub names the docs
show), a ZeRO-3 `ds_z3.json`, and `my_rewards.py` in the working directory. A command that is neither run nor listed
fails `test_every_command_is_run_or_listed`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import helpers
from trl_ext.testing import write_demo

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The README and every page under docs/.
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]

#: Commands that cannot run here, by the start of the command, with the reason.
NOT_RUN = {
    "python3 -m venv .venv": "installs from the package registry (network); test_install_lines_resolve checks it",
    "pip install -c constraints.txt": "the package registry (network); test_install_lines_resolve checks it",
    "trl-ext bench": "minutes on its own; tests/test_bench.py runs `trl-ext bench --quick` (every section)",
    "python -m pytest -q": "the test suite itself",
    # Run here, it would install TRL 1.14.2 into the environment under test, for every later test and subprocess.
    'pip install --no-deps "trl==': "changes the environment's TRL; .ci/run runs the matrix in overlays",
    "accelerate launch --num_processes 8": "8 processes: a GPU machine",
    "accelerate launch --use_deepspeed --deepspeed_config_file ds_z3.json --num_processes 8": "8 processes: GPUs",
    "python benchmarks/": "a benchmark of several minutes; test_benchmark_commands_name_existing_options checks it",
    "bash patches/check.sh": "downloads the trl sdist and installs into a fresh environment (network)",
    "echo /.whl/ >> .git/info/exclude": "prepares a checkout's wheels for the GPU machine (docs/benchmarks.md)",
    "python3 -m pip download": "the package registry (network): the GPU machine's wheels",
}

#: Extra arguments so the runnable training commands stay short here (2 steps of a tiny model).
_RECIPE_OVERRIDES = {"max_steps": 2, "per_device_train_batch_size": 2, "max_length": 64, "report_to": "none"}


def readme_commands(text: str) -> list[str]:
    """Shell commands in ```bash blocks: one per line (backslash continuations joined), comments dropped."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def doc_commands() -> list[str]:
    """Every shell command of the README and docs/, each once, in file order."""
    return list(dict.fromkeys(c for path in DOCS for c in readme_commands(path.read_text())))


def _not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


def _runnable() -> list[str]:
    return [c for c in doc_commands() if _not_run_reason(c) is None]


def _block(language: str, first_line: str) -> str:
    """The code block of `language` in the README or docs/ that starts with `first_line`."""
    for path in DOCS:
        for block in re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S):
            if block.startswith(first_line):
                return block
    raise AssertionError(f"no ```{language} block starts with {first_line!r} in the README or docs/")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    demo = write_demo(root / "demo")  # what `python -m trl_ext.testing demo` writes
    # The recipe of docs/configuration.md, with the hub names replaced by the demo and a short run.
    recipe = yaml.safe_load(_block("yaml", "# recipe.yaml\n"))
    recipe.update(model_name_or_path=str(demo / "model"), dataset_name=str(demo / "preferences"), **_RECIPE_OVERRIDES)
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (root / "ds_z3.json").write_text(json.dumps(helpers.deepspeed_config(3)))
    (root / "my_rewards.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n"
    )
    return root


def test_every_command_is_run_or_listed():
    commands = doc_commands()
    assert len(commands) >= 12, commands  # the extraction finds the commands of the README and docs/
    assert len(readme_commands(README.read_text())) >= 6
    unused = [prefix for prefix in NOT_RUN if not any(c.startswith(prefix) for c in commands)]
    assert not unused, f"NOT_RUN lists commands the README and docs/ no longer have: {unused}"
    assert _runnable(), "nothing to run"
    # A doc's install line run here would change the environment under test (it once put TRL 1.14.2 into the 1.16 one)
    installs = [c for c in _runnable() if re.match(r"(python3? -m )?pip3? ", c)]
    assert not installs, f"install commands must be listed in NOT_RUN: {installs}"


def test_readme_states_test_time_fast_loop_and_log_level():
    text = README.read_text()
    assert 'pytest -q -m "not slow"' in text and "TRL_EXT_LOG_LEVEL" in text
    assert re.search(r"\d+ (s|min)", text[text.index("## Tests") :]), "the Tests section says how long they take"


@pytest.mark.slow
@pytest.mark.parametrize("command", _runnable())
def test_readme_command_runs(command, workdir):
    demo = workdir / "demo"
    filled = command.replace("MODEL", str(demo / "model")).replace("PROMPTS", str(demo / "prompts"))
    if "online-dpo" in filled and "--per_device_train_batch_size" not in filled:
        filled += " --per_device_train_batch_size 2 --report_to none"
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_BUILD_OPS="0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python`, `trl-ext` of this environment
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", filled],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # `| head` may close the pipe early (SIGPIPE, 141) once it has its lines; anything else must succeed.
    ok = proc.returncode == 0 or ("| head" in filled and proc.returncode == 141)
    assert ok, f"{filled}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    if "--output_dir" in filled:  # a training run: it reports the plugins it ran with
        assert "ran with plugins:" in proc.stdout, proc.stdout[-2000:]
    if "--help" in filled:
        assert "trl-ext flags:" in proc.stdout


def _install_lines() -> list[str]:
    """The README's pip install lines (the first one after the venv step)."""
    lines = []
    for command in readme_commands(README.read_text()):
        for part in command.split("&&"):
            part = part.strip()
            if part.startswith("pip install"):
                lines.append(part)
    return lines


def test_install_lines_for_users_and_for_tests():
    """Users install trl-ext alone (plus DeepSpeed if they want it); the test extras are for the tests only."""
    import tomllib

    lines = _install_lines()
    assert lines[0] == "pip install -c constraints.txt -e ."
    assert 'pip install -c constraints.txt -e ".[deepspeed]"' in lines
    assert 'pip install -c constraints.txt -e ".[bench]"' in lines
    assert 'pip install -c constraints.txt -e ".[test]"' in lines
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"deepspeed", "bench", "test"} <= set(extras) and "pytest>=8" not in extras["deepspeed"] + extras["bench"]
    assert "torch==2.13.0" in (README.parent / "constraints.txt").read_text()


@pytest.mark.slow
def test_install_lines_resolve():
    """Each README install line resolves as printed against this environment (offline: `--dry-run --no-index`)."""
    for line in _install_lines():
        args = line.split()[2:]  # after `pip install`
        args = [a.strip('"') for a in args]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", *args]
        proc = subprocess.run(cmd, cwd=README.parent, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "Would install trl-ext" in proc.stdout, proc.stdout[-2000:]


# -------------------------------------------------------------------------------------------------------------------
# links, pages, layout and benchmark commands
# -------------------------------------------------------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_links_between_the_readme_and_docs_resolve():
    """Every relative link of the README and docs/ names a file that exists, and its `#anchor` a heading there."""
    checked = 0
    for path in DOCS:
        for link in _links(path):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            file = (path.parent / target).resolve() if target else path
            assert file.exists(), f"{path.relative_to(ROOT)}: link to {link}: no such file"
            if anchor:
                assert anchor in _anchors(file), f"{path.relative_to(ROOT)}: link to {link}: no such heading"
            checked += 1
    readme_links = {link.partition("#")[0] for link in _links(README)}
    for page in ("configuration", "lifecycle", "scale", "benchmarks", "writing-plugins", "architectures"):
        assert f"docs/{page}.md" in readme_links, f"the README does not link docs/{page}.md"
    assert checked >= 30


def test_every_builtin_plugin_has_a_readme_row_and_a_page():
    """Each built-in plugin: a row of the README's plugin table linking its page, and a page under docs/plugins/ with
    its generated settings; no page for a plugin that does not exist. The page is the one place for its prose: the
    plugin's module docstring is a summary of a few lines that points at it."""
    import importlib
    import inspect

    from trl_ext.manager import builtin_plugin_modules

    names = set(builtin_plugin_modules())
    readme = README.read_text()
    table = readme.split("<!-- generated: plugins -->", 1)[1].split("<!-- end generated: plugins -->", 1)[0]
    rows = set(re.findall(r"^\| \[`(\w+)`\]\(docs/plugins/(\w+)\.md\)", table, flags=re.M))
    assert rows == {(name, name) for name in names}
    pages = {p.stem for p in (ROOT / "docs" / "plugins").glob("*.md")}
    assert pages == names
    for name in names:
        page = (ROOT / "docs" / "plugins" / f"{name}.md").read_text()
        assert page.startswith(f"# {name}: "), name
        assert f"<!-- generated: settings {name} -->" in page, name
        doc = inspect.getdoc(importlib.import_module(f"trl_ext.plugins.{name}")) or ""
        assert doc.endswith(f"See docs/plugins/{name}.md.") and len(doc.splitlines()) <= 8, (name, doc)


def test_no_issue_numbers_in_the_readme_or_the_guides():
    """The README and the guides under docs/ read without the project's issue tracker."""
    for path in DOCS:
        if path.name in ("architectures.md", "versions.md"):  # generated elsewhere
            continue
        text = path.read_text()
        found = re.findall(r"\b[Ii]ssues? \d+|#\d{2,}\b|\bB\d+\b", text)
        assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_readme_layout_names_every_module():
    """The README's Layout names every module and package of trl_ext/, trl_ext/plugins/ and trl_ext/app/, and
    nothing that does not exist."""
    readme = README.read_text()
    layout = readme.split("## Layout", 1)[1].split("```", 2)[1]
    package = ROOT / "trl_ext"
    wanted = set()
    for folder in (package, package / "plugins", package / "app"):
        for entry in folder.iterdir():
            if entry.name == "__pycache__" or entry.name.startswith("."):
                continue
            if entry.suffix == ".py" and entry.name != "__init__.py" or entry.is_dir() and folder != package:
                wanted.add(entry.name + ("/" if entry.is_dir() else ""))
    wanted |= {"plugins/", "app/", "__init__.py"}
    named = set(re.findall(r"[\w.]+\.py|\w+/", layout))
    missing = sorted(w for w in wanted if w not in named)
    assert not missing, f"the README's Layout does not name {missing}"
    paths = [*package.rglob("*"), *ROOT.iterdir(), *ROOT.glob("tests/*")]
    existing = {p.name + ("/" if p.is_dir() else "") for p in paths}
    stale = sorted(n for n in named - wanted if n not in existing)
    assert not stale, f"the README's Layout names what does not exist: {stale}"


def _benchmark_commands() -> list[str]:
    """Every `python benchmarks/<script>.py ...` of the README and docs/, inline or in a block, joined across lines."""
    out = []
    for path in DOCS:
        text = " ".join(path.read_text().split())
        out += re.findall(r"python (benchmarks/\w+\.py(?: --?[\w-]+(?: [^\s`-][^\s`]*)?)*)", text)
    return out


def test_benchmark_commands_name_existing_options():
    """Each benchmark command the docs quote names a script of benchmarks/ and options that script declares."""
    commands = _benchmark_commands()
    assert len(commands) >= 8, commands
    for command in commands:
        script, *args = command.split()
        path = ROOT / script
        assert path.exists(), command
        source = path.read_text()
        runs = re.search(r"run_module\(\"([\w.]+)\"", source)  # a script that runs a trl_ext.app module
        if runs:
            source += (ROOT / (runs.group(1).replace(".", "/") + ".py")).read_text()
        for option in (a for a in args if a.startswith("--")):
            assert f'"{option}"' in source, f"`{command}`: {script} has no option {option}"
