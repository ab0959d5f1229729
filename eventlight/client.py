"""``agentlightning.client`` (0.1's ``AgentLightningClient``): not supported, see the error it raises."""

from eventlight.unavailable import unavailable_class

__all__ = ["AgentLightningClient", "DevTaskLoader"]

_LEGACY = "the 0.1 client/server protocol is not supported; use a LightningStore (e.g. JetStreamLightningStore)"
AgentLightningClient = unavailable_class("AgentLightningClient", _LEGACY, __name__)
DevTaskLoader = unavailable_class(
    "DevTaskLoader", f"{_LEGACY}; to try an agent on a few tasks use Trainer.dev", __name__
)
