"""0.1's ``AgentLightningServer`` (``agentlightning.server``): not supported, see the error it raises."""

from eventlight.unavailable import unavailable_class

__all__ = ["AgentLightningServer"]

AgentLightningServer = unavailable_class(
    "AgentLightningServer",
    "the 0.1 client/server protocol is not supported; an algorithm enqueues rollouts on a LightningStore "
    "(JetStreamLightningStore) and runners consume them",
    "eventlight.server",
)
