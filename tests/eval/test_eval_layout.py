"""The lab's layout: benchmark and evaluation scripts under eval/ import the shared modules (results and tables,
the benchmark harness, figures, the baselines, the accuracy runner's rows and result files) and never one another
(cycles: `tests/test_import_graph.py`)."""

import ast
from pathlib import Path

EVAL = Path(__file__).resolve().parents[2] / "eval"
SHARED = {"_common", "_harness", "_accuracy_methods", "_accuracy_results", "plot", "dense_baselines", "layer_graphs",
          "press_baselines", "static_decode", "tasks"}


def eval_imports() -> dict[str, set[str]]:
    """eval module -> the eval modules it imports (anywhere in the file: function-level imports count)."""
    graph = {}
    for path in [*EVAL.glob("*.py"), *EVAL.glob("*/*.py")]:  # scripts and shared modules, shared packages
        tree = ast.parse(path.read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eval."):
                names.add(node.module.split(".")[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "eval":
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("eval."))
        module = path.stem if path.parent == EVAL else path.parent.name
        graph[module] = graph.get(module, set()) | (names - {module})
    return graph


def test_no_eval_script_imports_another():
    graph = eval_imports()
    assert SHARED <= set(graph), SHARED - set(graph)
    for module, imported in graph.items():
        wrong = imported - SHARED
        assert not wrong, f"eval/{module}.py imports the script(s) {sorted(wrong)}: move what they share to {SHARED}"
