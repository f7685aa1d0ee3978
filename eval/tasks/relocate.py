"""Point a suite folder's lm-eval task YAMLs at its own data files after the folder was copied or moved."""

from __future__ import annotations

import re
from pathlib import Path

from oasis_hf.errors import OasisError

# The data line of `write_suite`'s task YAML: ``dataset_kwargs: data_files: test: <path>``.
_DATA_FILE = re.compile(r"^(    test: )(.+)$", re.M)


def relocate_suite(folder: str | Path) -> Path:
    """Rewrite the task YAMLs of the suite in `folder` to read ``folder/data/<file>``; returns `folder`.

    `write_suite` writes absolute data paths, because lm-eval hands ``data_files`` to `datasets`, which resolves a
    relative path against the working directory, not the YAML's folder. A suite copied elsewhere (a cache written on
    one machine and unpacked on another, or under another ``OASIS_HF_CACHE``) therefore still names its old place and
    fails when lm-eval loads the task. Only YAMLs that name another place are rewritten (so calling it again writes
    nothing); the group YAML has no data line and is left as it is.

    Raises:
        OasisError: a YAML names a data file that ``folder/data`` lacks (the folder is not a whole suite).
    """
    folder = Path(folder)
    data_dir = (folder / "data").resolve()
    for yaml in sorted(folder.glob("*.yaml")):
        text = yaml.read_text()
        match = _DATA_FILE.search(text)
        if match is None:
            continue
        data = data_dir / Path(match[2]).name
        if not data.is_file():
            raise OasisError(f"suite {folder}: {yaml.name} reads {Path(match[2]).name}, which is not in {data_dir}; "
                             "copy the whole suite folder, or write the suite again (python -m eval.tasks.make)")
        if match[2] != str(data):
            yaml.write_text(text[: match.start(2)] + str(data) + text[match.end(2):])
    return folder
