"""``agentlightning.config``: ``lightning_cli`` (0.3.0's argparse builder) is not built."""

from eventlight.unavailable import unavailable_function

__all__ = ["lightning_cli"]

lightning_cli = unavailable_function(
    "lightning_cli", "build the command line with argparse or typer and pass the values to Trainer", __name__
)
