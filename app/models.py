"""The one model the app holds in memory (`LOADED`), how a hub id is reached, and the image features kept per client.

Models load with safetensors weights only and never run remote code (`hap.load_model`). A hub id is loaded offline
(from the local cache, or a clear error within seconds) when the hub does not answer a 2-second connection
(`hub_reachable`); online, its download shows on the page's progress bar (tqdm tracked). Loading another model
replaces the held one only once the new one has loaded, and drops the old one's kept image features.
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from unittest import mock
from urllib.parse import urlparse

import huggingface_hub

import hap
from hap.runs.features import FeatureCache
from hap.options import NO_OPTIONS, ProcessorOptions
from hap.runs.run import free_memory

from .settings import is_local, resolve

FEATURE_CLIENTS = 16  # clients whose image features are kept (least recently served dropped), `FEATURE_IMAGES` each
FEATURE_IMAGES = 2  # the image asked about and one before it (an edit's original, a follow-up's first turn)
HUB_TIMEOUT_S = 2.0  # a hub that does not accept a connection within this is treated as offline


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether the hub (HF_ENDPOINT) accepts a TCP connection within `timeout` seconds; False in offline mode."""
    if huggingface_hub.constants.is_offline_mode():
        return False
    url = urlparse(huggingface_hub.constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


@contextmanager
def reaching(name: str) -> Iterator[None]:
    """A block that reads model `name` (weights or config): in offline mode (the cache, else a clear error at once)
    for a hub id when the hub is unreachable, instead of transformers' retries (about 25 s) before the same error."""
    offline = not is_local(name) and not hub_reachable()
    with mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True) if offline else nullcontext():
        yield


class LoadedModel:
    """The one model held in memory. Loading another replaces it only once the new one has loaded."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.model = None
        self.processor = None
        self.features: OrderedDict[str, FeatureCache] = OrderedDict()  # client -> its images' features
        self.options: ProcessorOptions = NO_OPTIONS  # the request's processor options (`planted`), reset after it

    def feature_cache(self, client: str) -> FeatureCache:
        """The image features kept for `client` (a session) on the loaded model; a new model starts empty."""
        cache = self.features.pop(client, None) or FeatureCache(FEATURE_IMAGES)
        self.features[client] = cache
        while len(self.features) > FEATURE_CLIENTS:
            self.features.popitem(last=False)
        return cache

    def get(self, name: str):
        """(model, processor) of `name`, loading it on first use; raises hap.ModelLoadError (the old one stays).
        A hub id loads offline when the hub is unreachable (`reaching`)."""
        if name != self.name:
            with reaching(name):
                model, processor = hap.load_model(resolve(name))
            self.model, self.processor, self.name = model, processor, name
            self.features.clear()  # another model's features are never reused
            free_memory()  # the replaced model's weights
        return self.model, self.processor

    def shape(self, name: str) -> tuple[int, int]:
        """(layers, query heads) of model `name`'s decoder: the loaded one's, else from its config (the weights are
        not loaded; a hub id offline when the hub does not answer, as `get`)."""
        from transformers import AutoConfig

        if self.name == name:
            config = self.model.config
        else:
            with reaching(name):
                config = AutoConfig.from_pretrained(resolve(name), trust_remote_code=False)
        text = config.text_config
        return text.num_hidden_layers, text.num_attention_heads

    def reset(self) -> None:
        """Leave the loaded model stock after a request, whatever happened (no patch left behind, no processor
        options)."""
        self.options = NO_OPTIONS
        if self.model is not None:
            hap.unpatch(self.model)


LOADED = LoadedModel()
