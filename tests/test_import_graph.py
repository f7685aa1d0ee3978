"""The package's import graph (grimp; imports under ``TYPE_CHECKING`` are annotations, not dependencies): no
cycles in `oasis_hf` or `eval`, and `oasis_hf`'s subpackages in layers, each importing only the ones below it."""

import pytest

grimp = pytest.importorskip("grimp", reason="grimp is in the dev extra; `pip install -e .[dev]`")

#: Highest first; the modules of one line are independent of each other.
LAYERS = (
    grimp.Layer("cli", "pipelines"),  # entry points
    "integrations",  # transformers and lm-eval glue: attention, fast path, capacity, lm-eval model
    grimp.Layer("speculative", "remote"),
    "decode_graph",
    "draft",
    "cache",
    "config",
    grimp.Layer("selectors", "kernels", "models"),
    grimp.Layer("compat", "errors"),
)


@pytest.mark.parametrize("package", ["oasis_hf", "eval"])
def test_no_import_cycles(package):
    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    cycles = sorted((importer, imported) for importer in graph.modules
                    for imported in graph.find_modules_directly_imported_by(importer)
                    if graph.chain_exists(importer=imported, imported=importer))
    assert not cycles, f"imports that close a cycle: {cycles}"


def test_subpackages_import_only_downwards():
    graph = grimp.build_graph("oasis_hf", exclude_type_checking_imports=True)
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS, containers={"oasis_hf"})
    assert not illegal, "\n".join(f"{d.importer} imports {d.imported}: {d.routes}" for d in illegal)
    top = {m.split(".")[1] for m in graph.modules if m.count(".") == 1}
    named = {name for layer in LAYERS for name in (layer.module_tails if hasattr(layer, "module_tails") else [layer])}
    assert top <= named, f"modules without a layer: {sorted(top - named)}"
