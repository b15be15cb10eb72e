"""Honest imports: the package faces are lazy, so the data layer loads no engine, and the module
graph has no circle."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the engine's leaves the data layer may read: the options and their registry, and the batch
# value with the architectures' layouts of a pair -- no layer
CONFIG_LAYER = {"tbp.nn", "tbp.nn.config", "tbp.nn.registry", "tbp.nn.batch"}


@pytest.mark.parametrize("module", ["tbp", "tbp.tokenizer", "tbp.data", "tbp.pairs", "tbp.corpus", "tbp.dataprep",
                                    "tbp.textprep", "tbp.chat", "tbp.errors", "tbp.config", "tbp.nn.config",
                                    "tbp.batches"])
def test_the_data_layer_loads_no_engine(module):
    code = (f"import sys, {module}\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('tbp.nn'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.split())
    assert loaded <= CONFIG_LAYER, sorted(loaded - CONFIG_LAYER)


def test_the_face_still_gives_the_model_and_its_loader():
    code = "import tbp; from tbp import GPT, ModelConfig; print(GPT.load is not None, ModelConfig().n_layer)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["True", "4"]


@pytest.mark.parametrize("first", ["tbp.nn.designs.sparse", "tbp.nn.designs.flash", "tbp.nn.designs.encdec",
                                   "tbp.nn.designs", "tbp.nn.build"])
def test_every_declaration_is_asked_whichever_module_is_imported_first(first):
    """A design imported before the builder still has its declaration in build.VARIANTS (the
    registry's own list), the core's options first: the checks and refusals see every variant."""
    code = (f"import {first}\nfrom tbp.nn import build, ModelConfig\n"
            "print(' '.join(v.key for v in build.VARIANTS))\n"
            "try:\n    ModelConfig(arch='encoder-decoder', positions='rope')\nexcept ValueError:\n    print('refused')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split("\n")
    keys = out[0].split()
    assert keys[:2] == ["dropout", "recompute"] and "encoder-decoder" in keys and len(set(keys)) == len(keys)
    assert out[1] == "refused"


def _imports(path: Path) -> set[str]:
    """The tbp modules ``path`` imports, at its top or inside a function (a deferred import is
    still an arrow of the graph)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.rsplit(".", 1)[0] + "." + "__init__"
    base = package.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                root = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{root}.{node.module}" if node.module else root
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            out |= {n for n in names if (ROOT / Path(*n.split("."))).with_suffix(".py").is_file()} or {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("tbp")}


def test_no_two_modules_import_each_other():
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "tbp").rglob("*.py")
             if p.name != "__init__.py"}
    edges = {m: _imports(p) & set(files) for m, p in files.items()}
    pairs = sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if a in edges.get(b, ())})
    assert not pairs, pairs
