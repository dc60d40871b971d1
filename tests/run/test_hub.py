"""A hub model or dataset that cannot be fetched: the same advice offline and cut off from the
network, given at once (huggingface_hub would retry for half a minute before its own sentence)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from compressor import hub
from compressor.cli import main
from tests.run.test_cli import write_recipe


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode on a machine whose resolver knows no host (as here, or on a train)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *hub.PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)

    def fail(*_: object, **__: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    hub._resolves.cache_clear()
    yield
    hub._resolves.cache_clear()


@pytest.mark.parametrize("online", [False, True])
def test_a_hub_model_that_cannot_be_fetched_gets_the_same_advice_at_once(
    online: bool, request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if online:
        request.getfixturevalue("no_network")
    recipe = write_recipe(tmp_path, tiny_checkpoint, model__path="mistralai/Mistral-Nemo-Base-2407")
    started = time.perf_counter()
    assert main(["run", str(recipe)]) == 2
    assert time.perf_counter() - started < 10  # no retries against a network that is not there
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not in the cache" in err
    assert ("huggingface.co cannot be reached" if online else "offline mode is on") in err
    assert "local model folder" in err and "HF_TOKEN" in err and "hf auth login" in err
    assert not (tmp_path / "out").exists()


def test_behind_a_proxy_the_hub_is_not_probed(monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    assert hub.unreachable() is not None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub.unreachable() is None  # the proxy resolves names: the load itself decides


def test_a_gated_repository_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "unreachable", lambda: None)
    advice = hub.model_advice(OSError("401 Client Error: access to model X is restricted; you must be authenticated"))
    assert "gated or private" in advice and "HF_TOKEN" in advice


def test_a_hub_dataset_that_cannot_be_fetched_gets_advice(no_network: None) -> None:
    from compressor.data.text import load_records
    from compressor.errors import UserError

    with pytest.raises(UserError, match="huggingface.co cannot be reached.*local data files.*HF_TOKEN"):
        load_records({"path": "someone/no-such-dataset-here"})
