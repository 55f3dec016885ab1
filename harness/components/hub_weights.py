"""A timm model's ImageNet weights, from the Hugging Face hub's cache when they are there.

timm downloads its weights through ``huggingface_hub``, which retries an unreachable hub
five times per file with a growing pause, for two files: about 50 s of warnings before a
machine without a network learns that the weights are missing. Here a cached file loads
without asking the hub, and a missing file on a machine that cannot reach the hub fails at
once, so the caller can say so in one line."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit
from urllib.request import getproxies

from torch import nn

__all__ = ["WeightsOffline", "cached_weights_file", "hub_reachable", "pretrained_timm_model"]

#: The files timm looks for in a model's hub repository, in the order it tries them.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

#: How long the reachability probe waits for the hub's host to accept a connection.
PROBE_SECONDS = 3.0


class WeightsOffline(Exception):
    """The weights are not in the hub's cache and the hub cannot be reached."""


def cached_weights_file(timm_name: str) -> str | None:
    """The path of ``timm_name``'s weights in the hub's cache, or ``None``."""
    # deferred: timm adds 0.4 s to --help and methods (the plugins import this module)
    import huggingface_hub
    import timm

    pretrained_cfg = timm.models.get_pretrained_cfg(timm_name)
    hub_id = pretrained_cfg.hf_hub_id if pretrained_cfg is not None else None
    if not hub_id:
        return None
    for filename in WEIGHT_FILES:
        found = huggingface_hub.try_to_load_from_cache(hub_id, filename)
        if isinstance(found, str):
            return found
    return None


def hub_reachable() -> bool:
    """Whether offline mode (``HF_HUB_OFFLINE``) is off and the hub's host (``HF_ENDPOINT``)
    accepts a connection. Behind a proxy the host is not probed (the proxy may be the only
    way out): the download is tried."""
    # deferred: huggingface_hub is only needed where pretrained weights are asked for
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlsplit(constants.ENDPOINT)
    if endpoint.scheme in getproxies():
        return True
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "", port), timeout=PROBE_SECONDS):
            return True
    except OSError:
        return False


def pretrained_timm_model(timm_name: str, **kwargs) -> nn.Module:
    """``timm.create_model(timm_name, pretrained=True, **kwargs)``, from the cached weights
    file when there is one (no request to the hub), else downloaded.

    Raises :class:`WeightsOffline` without a request when the file is not cached and the hub
    cannot be reached."""
    # deferred: timm adds 0.4 s to --help and methods (the plugins import this module)
    import timm

    cached = cached_weights_file(timm_name)
    if cached is not None:
        overlay = {"file": cached}
        return timm.create_model(
            timm_name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs
        )
    if not hub_reachable():
        raise WeightsOffline(f"{timm_name}: not in the hub's cache, and the hub is unreachable")
    return timm.create_model(timm_name, pretrained=True, **kwargs)
