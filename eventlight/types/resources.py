"""``agentlightning.types.resources``: the resource types (``eventlight.core.types``)."""

from eventlight.core.types import LLM, NamedResources, PromptTemplate, ProxyLLM, Resource, ResourcesUpdate

__all__ = ["LLM", "NamedResources", "PromptTemplate", "ProxyLLM", "Resource", "ResourcesUpdate"]
