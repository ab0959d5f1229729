"""``make demo``: the main job. GRPO on sums by default; ``--algorithm apo`` runs the APO demo.

    python examples/demo.py [--algorithm grpo|apo] [options of that demo]

``grpo`` is ``examples/arithmetic/train_grpo.py`` (SmolLM2-135M learns, on the CPU, in minutes);
``apo`` is ``examples/room_booking/train_apo.py`` unchanged (prompt optimisation, its LLM check and
run id). ``--help`` after the algorithm shows that demo's options, with ``--algorithm``; a refused
option is one ``error:`` line, exit 2 (``examples/demo_args.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.demo_args import OneLineParser  # noqa: E402
from examples.interrupt import TermAsInterrupt  # noqa: E402

ALGORITHMS = ["grpo", "apo"]
USAGE = 'make demo ARGS="[--algorithm {grpo,apo}] [OPTIONS]"  (or: python examples/demo.py [...])'


def _add_algorithm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithm", choices=ALGORITHMS, default="grpo", help="which demo: grpo (default) or apo")


OTHER_HELP = {
    "grpo": 'The APO demo has options of its own: make demo ARGS="--algorithm apo --help" lists them.',
    "apo": 'The GRPO demo (the default) has options of its own: make demo ARGS="--help" lists them.',
}
"""The last line of each demo's ``--help``: where the other demo's options are listed."""


def demo_parser(demo_doc: str | None, algorithm: str = "grpo") -> argparse.ArgumentParser:
    """The parser of ``make demo`` with the options of demo ``algorithm`` (one of ``ALGORITHMS``) to
    come: its usage is the ``make`` command, its description the demo's docstring without the demo
    script's own command line, it has ``--algorithm``, and its help ends with where the other demo's
    options are listed; a refused option is one ``error:`` line (``OneLineParser``)."""
    lines = (demo_doc or "").splitlines()
    description = "\n".join(line for line in lines if not line.lstrip().startswith("python examples/"))
    p = OneLineParser(
        prog="make demo",
        usage=USAGE,
        description=description,
        epilog=OTHER_HELP[algorithm],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_algorithm(p)
    return p


def main(argv: list[str] | None = None) -> int:
    first = OneLineParser(prog="make demo", add_help=False)
    _add_algorithm(first)
    args, rest = first.parse_known_args(argv)
    if args.algorithm == "apo":
        from examples.room_booking import train_apo as demo
    else:
        from examples.arithmetic import train_grpo as demo  # type: ignore[no-redef]
    from eventlight.logging import log_level_from_env

    level, warning = log_level_from_env("WARNING")  # a level no logger knows: a warning, not a traceback
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    demo_args = demo.parse_args(sys.argv[1:] if argv is None else argv, demo_parser(demo.__doc__, args.algorithm))
    stop = TermAsInterrupt().install()  # SIGTERM: the same orderly stop as Ctrl+C, exit 143
    try:
        return asyncio.run(stop.guard(demo.main(demo_args)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        if args.algorithm == "grpo":  # the command that continues it from its last checkpoint
            print(demo.interrupted(demo_args.run_id, rest, _make_demo), file=sys.stderr)
        else:
            print("interrupted", file=sys.stderr)
        return stop.exit_code


def _make_demo(options: list[str]) -> str:
    """``make demo ARGS="<options>"`` (``make demo`` without options), as README.md writes it."""
    return f'make demo ARGS="{shlex.join(options)}"' if options else "make demo"


if __name__ == "__main__":
    raise SystemExit(main())
