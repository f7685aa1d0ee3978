"""Finding Mooncake's service executables: on PATH, or beside the interpreter of a virtual environment that is not
activated (how `scripts/test.sh` and CI run the suite); what is missing is named."""

import os
import stat

import pytest

from oasis_hf.errors import RemoteTierError
from oasis_hf.remote import MooncakeCluster, mooncake
from oasis_hf.remote.mooncake import service_binary


def _executable(path):
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_services_beside_the_interpreter_are_found_without_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(mooncake.sys, "executable", str(tmp_path / "python"))
    assert service_binary("mooncake_master") is None
    master = _executable(tmp_path / "mooncake_master")
    assert service_binary("mooncake_master") == str(master)
    (tmp_path / "mooncake_client").write_text("not executable")
    assert service_binary("mooncake_client") is None
    on_path = tmp_path / "bin"
    on_path.mkdir()
    client = _executable(on_path / "mooncake_client")
    monkeypatch.setenv("PATH", f"{on_path}{os.pathsep}{tmp_path / 'empty'}")
    assert service_binary("mooncake_client") == str(client)


def test_missing_services_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mooncake.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(mooncake, "_import_store", lambda: None)  # the client library is not what this checks
    why = mooncake.mooncake_missing()
    assert "['mooncake_master', 'mooncake_client']" in why and str(tmp_path / "python") in why
    assert not mooncake.mooncake_available()
    with pytest.raises(RemoteTierError, match="service executables"):
        MooncakeCluster(1 << 20).start()
