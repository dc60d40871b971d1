"""The Hugging Face hub, as a run meets it: whether it can be reached, and what to tell a user
whose model or dataset could not be fetched (the same advice online, offline, or cut off)."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
HUB_ADVICE = (
    "Use a local model folder or one already in the cache (HF_HUB_OFFLINE=1 reads the cache without "
    "waiting for the network); for gated repositories such as Mistral's or Llama's, accept the licence "
    "on the model's page and log in (`hf auth login`) or set HF_TOKEN"
)


def offline() -> bool:
    """Whether the hub is off limits (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set)."""
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def endpoint_host() -> str:
    """The hub's host name (HF_ENDPOINT may point at a mirror)."""
    return urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"


def unreachable() -> str | None:
    """Why the hub cannot be reached from here, or None when it may be. Offline mode says so;
    otherwise the host's name is resolved (instant where there is no network, where
    huggingface_hub would retry for half a minute). Behind a proxy nothing is probed: the proxy
    resolves names, not this machine."""
    if offline():
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    return _resolves(endpoint_host())


@functools.cache
def _resolves(host: str) -> str | None:
    """None when `host` has an address; else why not (asked once per process)."""
    try:
        socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except OSError as error:
        return f"{host} cannot be reached ({error.strerror or error})"
    return None


def cached(repo_id: str, filename: str, revision: str | None) -> bool:
    """Whether the hub cache holds `filename` of `repo_id` (so a run can go on without a network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
    except Exception:  # an id that is not a repo id: not cached
        return False


def model_advice(error: BaseException | None = None) -> str:
    """The end of the line for a hub model that could not be loaded: why, when it is known, then
    what to do (the same online, offline or cut off)."""
    why = unreachable()
    text = str(error or "")
    if why is None and any(word in text for word in ("gated", "401", "403", "restricted", "authenticated")):
        why = "the repository is gated or private"
    return f"{'; ' + why if why else ''}. {HUB_ADVICE}"


def dataset_advice() -> str:
    """The end of the line for a hub dataset that could not be loaded."""
    why = unreachable()
    return (
        f"{'; ' + why if why else ''}. Use local data files (path: json, data_files: ...) or a dataset "
        f"already in the cache; for a gated dataset, log in (`hf auth login`) or set HF_TOKEN"
    )
