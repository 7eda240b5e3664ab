"""Dependencies run one way: core <- plugins <- tooling packages <- tools/tests.

Every `import` statement under runtime/ and plugins/ is read with `ast` (those inside functions
too: a lazy import is a dependency all the same). The core (`runtime/outrider`) may import no
plugin package, and a plugin may import only its own package besides the core and third parties.
What two plugins both need belongs in the core (e.g. `outrider.onnx`).

A plugin is what pyproject.toml registers in the `outrider` entry-point group (plus the test
plugins in tests/plugins). A package under plugins/ that registers nothing is a tooling package
(TOOLING_PACKAGES): it makes artifacts that a plugin serves, so it may import that plugin; no
plugin, and not the core, may import a tooling package, so serving never loads one.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime"
PLUGINS = ROOT / "plugins"

#: files allowed to break the rule for now, relative to the repository root, each with why
KNOWN_EXCEPTIONS: set[str] = set()

#: packages under plugins/ that are not plugins (no entry point) -> the plugins each may import, with why
TOOLING_PACKAGES: dict[str, set[str]] = {
    # The draft head's trainer (tools/train_draft.py) writes the head files outrider_speculative
    # serves, with its torch DraftHead, save_head and fingerprint: one definition of the format.
    "outrider_draft_training": {"outrider_speculative"},
}


def plugin_packages() -> set[str]:
    """Top-level names of the built-in plugins (pyproject.toml's `outrider` entry points) and the
    test plugins (tests/plugins/)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    entry_points = project["project"]["entry-points"]["outrider"]
    names = {value.split(":")[0].split(".")[0] for value in entry_points.values()}
    names |= {p.stem for p in (ROOT / "tests" / "plugins").glob("outrider_*.py")}
    return names


def imported_roots(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of each absolute import in `tree`; relative imports stay inside a package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def forbidden_imports(root: Path, own_package: str | None, plugins: set[str], base: Path = ROOT) -> list[str]:
    """'file:line imports X' for each package of `plugins` imported under `root` other than `own_package`."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(base).as_posix()
        if where in KNOWN_EXCEPTIONS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
        for line, package in imported_roots(tree):
            if package in plugins and package != own_package:
                problems.append(f"{where}:{line} imports {package}")
    return problems


def test_the_plugin_set_is_found() -> None:
    # Guards the tests below against passing because they found nothing to check.
    plugins = plugin_packages()
    assert {"outrider_onnxruntime", "outrider_tensorrt", "outrider_torch", "outrider_http"} <= plugins
    assert "outrider" not in plugins and not plugins & set(TOOLING_PACKAGES)


def test_every_package_under_plugins_is_a_plugin_or_a_listed_tooling_package() -> None:
    packages = {p.name for p in PLUGINS.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    unknown = packages - plugin_packages() - set(TOOLING_PACKAGES)
    assert not unknown, f"packages under plugins/ with no entry point and not in TOOLING_PACKAGES: {sorted(unknown)}"
    assert set(TOOLING_PACKAGES) <= packages


def test_the_core_imports_no_plugin() -> None:
    problems = forbidden_imports(RUNTIME / "outrider", None, plugin_packages() | set(TOOLING_PACKAGES))
    assert not problems, "the core imports a plugin package (move what it needs into the core):\n" + "\n".join(problems)


def plugin_import_problems(plugins_dir: Path = PLUGINS, base: Path = ROOT) -> list[str]:
    """Imports under `plugins_dir` that break the rule: a plugin importing another plugin or any tooling
    package, a tooling package importing a plugin it is not listed for."""
    plugins, problems = plugin_packages(), []
    for package in sorted(p for p in plugins_dir.iterdir() if p.is_dir()):
        if package.name in plugins:
            problems += forbidden_imports(package, package.name, plugins | set(TOOLING_PACKAGES), base)
        elif package.name in TOOLING_PACKAGES:
            problems += forbidden_imports(package, package.name, plugins - TOOLING_PACKAGES[package.name], base)
    return problems


def test_no_plugin_imports_another() -> None:
    problems = plugin_import_problems()
    assert not problems, ("a plugin imports another plugin's or a tooling package (what both need belongs in the "
                          "core; a tooling package imports only the plugins TOOLING_PACKAGES lists):\n"
                          + "\n".join(problems))


def test_the_plugin_rule_bites(tmp_path) -> None:
    # A plugin that imports a tooling package (lazily, too) is reported, and so is a tooling package
    # that imports a plugin it is not listed for; the listed import is not.
    (tmp_path / "outrider_speculative").mkdir()
    (tmp_path / "outrider_speculative" / "strategy.py").write_text(
        "def train():\n    from outrider_draft_training.cli import run\n")
    (tmp_path / "outrider_draft_training").mkdir()
    (tmp_path / "outrider_draft_training" / "trainer.py").write_text(
        "from outrider_speculative.eagle import DraftHead\nimport outrider_llm\n")
    assert plugin_import_problems(tmp_path, tmp_path) == [
        "outrider_draft_training/trainer.py:2 imports outrider_llm",
        "outrider_speculative/strategy.py:2 imports outrider_draft_training",
    ]


def test_the_check_names_file_and_line() -> None:
    # The walker itself: a lazy plugin import inside a function is found, relative imports are not.
    source = "import os\nfrom . import sibling\n\ndef f():\n    from outrider_torch.x import y\n    import outrider_http\n"
    found = sorted(imported_roots(ast.parse(source)))
    assert found == [(1, "os"), (5, "outrider_torch"), (6, "outrider_http")]


def import_graph(root: Path, top: Path) -> dict[str, set[str]]:
    """{module: the modules it imports} over the .py files under `root`, named as imported from `top`
    (runtime/ for the core, plugins/ for the plugins, tools/ for the tools), lazy imports included;
    an import of a package counts as one of its `__init__`, and a module's own packages are not edges."""
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(top).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = known(target)
                if found and found != name and not name.startswith(found + "."):
                    edges.add(found)
        graph[name] = edges
    return graph


def core_import_graph() -> dict[str, set[str]]:
    """The core's import graph (runtime/outrider)."""
    return import_graph(RUNTIME / "outrider", RUNTIME)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first walk, as the modules on it (first repeated at the end)."""
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                cycles.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_core_has_no_import_cycle() -> None:
    graph = core_import_graph()
    assert {"outrider.server", "outrider.serving.instance", "outrider.worker.proxy"} <= set(graph)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in runtime/outrider (lazy imports count):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_echo_template_builds_as_a_plugin_of_its_own(tmp_path) -> None:
    """plugins/outrider_echo is the folder a plugin author copies: its own pyproject builds a wheel
    whose entry point registers the backend (built offline, with the setuptools installed here)."""
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                    "--wheel-dir", str(tmp_path), str(PLUGINS / "outrider_echo")], check=True, timeout=120,
                   cwd=tmp_path)
    wheel = next(tmp_path.glob("outrider_echo-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "outrider_echo/__init__.py" in names
    assert "[outrider]" in entry_points and "echo = outrider_echo" in entry_points


def _cycles_text(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_plugin_has_an_import_cycle() -> None:
    graph = import_graph(PLUGINS, PLUGINS)
    assert {"outrider_llm.native_model", "outrider_http.kserve", "outrider_speculative.strategy"} <= set(graph)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in plugins/ (lazy imports count):\n" + _cycles_text(cycles)


def test_the_tools_have_no_import_cycle() -> None:
    graph = import_graph(ROOT / "tools", ROOT / "tools")
    assert {"bench", "bench_sizes", "bench_draft_model"} <= set(graph)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles in tools/ (lazy imports count):\n" + _cycles_text(cycles)


def private_imports(root: Path, base: Path = ROOT) -> list[str]:
    """'file:line imports NAME from MODULE' for each `from X import _name` under `root` (lazy ones too):
    what one module shares with another is public in its home module."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        if "build" in path.relative_to(base).parts:
            continue
        where = path.relative_to(base).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        problems.append(f"{where}:{node.lineno} imports {alias.name} from "
                                        f"{'.' * node.level}{node.module or ''}")
    return problems


def test_no_module_imports_another_modules_private_names() -> None:
    problems = private_imports(RUNTIME / "outrider") + private_imports(PLUGINS)
    assert not problems, "private names imported across modules (make them public where they live):\n" + "\n".join(problems)


def test_the_private_import_check_finds_one(tmp_path) -> None:
    (tmp_path / "m.py").write_text("from .other import _secret, public\n\ndef f():\n    from x import __version__\n")
    assert private_imports(tmp_path, tmp_path) == ["m.py:1 imports _secret from .other"]
