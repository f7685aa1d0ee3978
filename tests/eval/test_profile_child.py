"""Benchmarks profile in a child process, never in the process that times (CUPTI slows every later launch)."""

import sys
import textwrap

from eval._common import PROFILE_CHILD_FLAG, merge_profiles, profiles_from_child

CHILD = textwrap.dedent(f"""
    import json, sys
    from pathlib import Path
    argv = sys.argv[1:]
    assert "{PROFILE_CHILD_FLAG}" in argv, argv
    assert argv.count("--out") == 1 and not any(a.startswith("--out=") for a in argv), argv
    out = Path(argv[argv.index("--out") + 1])
    rows = [{{"method": "a", "batch": 8, "context": 64, "profile": {{"families": {{"x": 1}}}}, "args": argv}}]
    out.with_name(out.name + ".json").write_text(json.dumps({{"rows": rows}}))
""")


def test_profiles_from_child_passes_the_arguments_and_its_own_out(tmp_path, monkeypatch):
    (tmp_path / "fake_bench.py").write_text(CHILD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    rows = profiles_from_child("fake_bench", ["--points", "8x64", "--out", "parent/result", "--profile",
                                              "--out=parent2"], tmp_path)
    args = rows[0]["args"]
    assert args[:3] == ["--points", "8x64", "--profile"]  # the parent's --out (both spellings) left out
    assert "parent/result" not in args and "--out=parent2" not in args
    assert args[-1].startswith(str(tmp_path))


def test_merge_profiles_matches_rows_by_key_only():
    rows = [{"method": "a", "batch": 8, "context": 64, "ms": 1.0}, {"method": "a", "batch": 1, "context": 64},
            {"method": "b", "batch": 8, "context": 64}]
    child = [{"method": "a", "batch": 8, "context": 64, "ms": 9.0, "profile": {"families": {}}},
             {"method": "b", "batch": 8, "context": 64}]  # no profile: nothing to merge
    assert merge_profiles(rows, child) == 1
    assert rows[0]["profile"] == {"families": {}} and rows[0]["ms"] == 1.0  # the child's timing is not taken
    assert "profile" not in rows[1] and "profile" not in rows[2]


def test_every_decode_step_kernel_has_a_profile_family_of_its_own():
    """A Triton kernel of the decode step that the profile table files under "other PyTorch kernels" hides our own
    time among the model's: each one, found by name in its module, matches a family before the catch-all."""
    import re
    from pathlib import Path

    import oasis_hf.kernels
    from eval._harness import FAMILIES, family

    other = FAMILIES[-1][0]
    root = Path(oasis_hf.kernels.__file__).parent
    modules = ["sparse_attention", "append_tokens", "copy_rows", "score_blocks", "plan_blocks", "gather_blocks"]
    kernels = {name for module in modules
               for name in re.findall(r"def (_\w+_kernel)\(", (root / f"{module}.py").read_text())}
    assert {"_sparse_attention_kernel", "_merge_append_kernel", "_gather_blocks_kernel"} <= kernels
    assert {name: family(name) for name in kernels if family(name) == other} == {}
