"""Server launching (``agentlightning.utils.server_launcher``): eventlight starts its servers with
``eventlight up`` / ``eventlight.prepare_services``."""

from eventlight.ops import ensure_services, prepare_services, stop_services

__all__ = ["ensure_services", "prepare_services", "stop_services"]
